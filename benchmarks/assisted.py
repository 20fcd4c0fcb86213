"""Assisted decoding: an fp32 engine with its own int4 build as the assistant, against plain greedy, on real models.

usage: python -m benchmarks.assisted [--models smollm2-135m gemma-3-270m] [--new-tokens 96] [--rounds 3]

Per model and prompt (three chat prompts: repeat a passage, write a story, answer a question), plain greedy on the fp32
engine and assisted greedy (the int4 engine drafting: transformers' heuristic schedule from 20, and a constant 4)
run in turn, ``--rounds`` times interleaved; each entry is the median round. tokens/s is generated tokens / the whole
generate call (prefill included). Every assisted run's tokens are compared with plain greedy's (they must be equal:
the fp32 engine verifies every token). Writes benchmarks/results/assisted.json and assisted.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import trtinfer
from benchmarks.machine import machine_info, result_path
from trtinfer.builder import BuildConfig, build

HERE = Path(__file__).parent
PROMPTS = {
    "repeat a passage": "Repeat this text exactly: The history of the city of Paris begins in antiquity, when a Celtic "
                        "tribe, the Parisii, settled on an island in the Seine. The Romans conquered the basin in 52 "
                        "BC and built a town on the left bank, which they called Lutetia.",
    "write a story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "answer a question": "Why is the sky blue? Explain it to a ten-year-old.",
}
MODES = {"plain": None, "assisted (heuristic from 20)": {"num_assistant_tokens": 20},
         "assisted (constant 4)": {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma-3-270m"])
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(result_path("assisted")))
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for model in args.models:
        paths = {p: HERE / ".engines" / f"{model}-{p}-cpu" for p in ("fp32", "int4")}
        for p, path in paths.items():
            build(model, path, BuildConfig(precision=p), overwrite=True, progress=False)
        with trtinfer.load(paths["fp32"]) as eng, trtinfer.load(paths["int4"]) as draft:
            for name, prompt in PROMPTS.items():
                kw = {"max_new_tokens": args.new_tokens, "do_sample": False}
                eng.generate([prompt], chat=True, **kw)  # warm-up
                times: dict[str, list[float]] = {m: [] for m in MODES}
                out: dict[str, Any] = {}
                for _ in range(args.rounds):
                    for mode, extra in MODES.items():
                        t0 = time.perf_counter()
                        r = eng.generate([prompt], chat=True, **kw, **({"assistant": draft, **extra} if extra else {}))[0]
                        times[mode].append(time.perf_counter() - t0)
                        out[mode] = (r, extra)
                plain = out["plain"][0]
                for mode in MODES:
                    r, st = out[mode]
                    t = statistics.median(times[mode])
                    row = {"model": model, "prompt": name, "mode": mode, "tokens": len(r.token_ids),
                           "tok_s": round(len(r.token_ids) / t, 1),
                           "speedup": round(statistics.median(times["plain"]) / t, 2),
                           "same_tokens": r.token_ids == plain.token_ids,
                           "acceptance": None if st is None else round(r.accepted_tokens / max(1, r.draft_tokens), 3),
                           "passes": None if st is None else len(r.token_ids) - 1 - r.accepted_tokens}
                    rows.append(row)
                    print(f"{model:<14} {name:<18} {mode:<28} {row['tok_s']:6.1f} tok/s  x{row['speedup']:.2f}  "
                          f"accept {row['acceptance']}  same {row['same_tokens']}", flush=True)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
                                    "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows}, indent=2))
    chart(rows, out_path.with_suffix(".png"))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model"], r["prompt"]) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        vals = [next(r["speedup"] for r in rows if (r["model"], r["prompt"]) == g and r["mode"] == mode)
                for g in groups]
        bars = ax.bar([j + i * width for j in range(len(groups))], vals, width, label=mode)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([j + width * (len(MODES) - 1) / 2 for j in range(len(groups))],
                  [f"{m}\n{p}" for m, p in groups], fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tokens/s, x plain greedy (fp32 engine)")
    ax.set_title("assisted decoding: the int4 build drafts for the fp32 engine (same tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
