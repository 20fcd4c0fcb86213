"""Prompt-lookup decoding against plain greedy on SmolLM2-135M: tokens/s, speed-up, acceptance, same tokens.

usage: python -m benchmarks.speculative [--precisions fp32 int4] [--ks 3 5 10] [--new-tokens 128] [--rounds 5]
Three chat prompts: (a) repeat a ~150-word passage verbatim, (b) edit a function (rename a variable, return the
whole code), (c) a question with nothing to copy. Per engine and prompt, plain greedy and prompt_lookup_num_tokens=K
for each K run in turn, ``--rounds`` times (interleaved, so a burst of other load on the machine hits one round of
every column, not one column); each entry is the median round. tokens/s is generated tokens / the whole generate
call (prefill included, which both columns share); decode tokens/s leaves the prefill out. Every lookup run's tokens
are compared with plain greedy's. A second table profiles one pass of the fp32 engine per KV layout (shared buffers,
concat): a one-token decode step, ``run_chunk`` with 1..11 tokens (a verification pass of K = 0..10), and
``truncate_cache``. Writes benchmarks/results/speculative.json and benchmarks/results/speculative.png.

"same tokens" is expected on fp32 only: the int4 engine's MatMulNBits (int8 activations) give logits up to ~0.6
apart between a one-row and a several-row pass, so its prompt-lookup output may leave plain greedy's at such a gap.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import trtinfer
from benchmarks.machine import machine_info, result_path
from trtinfer.builder import BuildConfig, build
from trtinfer.runtime.generator import GenerationResult

HERE = Path(__file__).parent
RESULTS = HERE / "results"
MODEL = "smollm2-135m"

PASSAGE = (
    "The lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick, and polished the great lens until it shone. Ships passing in the dark "
    "relied on its steady beam to find their way around the rocks that had claimed so many vessels before. When "
    "the keeper grew old, the town decided to replace the flame with an electric lamp, and a young engineer came "
    "from the city to install it. She spent a whole summer on the cliff, running cables up the tower and testing "
    "the new light on foggy evenings. The old keeper watched her work in silence at first, but soon he began to "
    "bring her coffee and tell her stories about the storms he had seen. By the end of the summer the lamp was "
    "ready, and the whole town gathered on the cliff to watch it shine for the first time."
)
CODE = '''def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("value") is None:
            continue
        total += record["value"]
        count += 1
    if count == 0:
        return {"total": 0, "count": 0, "mean": None}
    mean = total / count
    return {"total": total, "count": count, "mean": mean}
'''
PROMPTS = {
    "repeat passage": f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    "edit code": f"Rename the variable `total` to `running_sum` in this Python function and return the whole "
                 f"updated function:\n\n```python\n{CODE}```",
    "nothing to copy": "Why do cats purr? Explain in a few sentences.",
}


def engine_dir(precision: str, layout: str = "shared_buffer") -> Path:
    """Build (from the content-hash cache: seconds once exported) and return the engine directory."""
    suffix = "" if layout == "shared_buffer" else f"-{layout}"
    out = HERE / ".engines" / f"{MODEL}-{precision}-cpu{suffix}"
    kw: dict[str, Any] = {"precision": precision}
    if layout == "concat":
        kw["disable_passes"] = ("attention",)
    if not (out / "manifest.json").is_file():
        build(MODEL, out, BuildConfig(**kw), overwrite=True, progress=False)
    return out


@dataclasses.dataclass
class LookupStats:
    """One generation's drafting: passes after the prefill, draft tokens proposed and kept."""

    passes: int
    drafted: int
    accepted: int

    def to_dict(self) -> dict[str, float | int]:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(rate, 4)}


def run_once(eng: Any, ids: list[int], new_tokens: int, k: int | None
             ) -> tuple[GenerationResult, float, LookupStats | None]:
    """One generate of ``ids`` (plain greedy when ``k`` is None): result, wall seconds, lookup stats."""
    cfg = dataclasses.replace(eng.generation_defaults, max_new_tokens=new_tokens, prompt_lookup_num_tokens=k,
                              do_sample=False)
    t0 = time.perf_counter()
    res = eng.generate(input_ids=[ids], config=cfg)[0]
    wall = time.perf_counter() - t0
    # each pass after the prefill keeps its accepted draft tokens and one token of the model's own
    stats = LookupStats(len(res.token_ids) - 1 - res.accepted_tokens, res.draft_tokens, res.accepted_tokens)
    return res, wall, None if k is None else stats


def compare(eng: Any, precision: str, ks: Sequence[int], new_tokens: int, rounds: int) -> list[dict[str, Any]]:
    """Plain greedy and each K on every prompt, interleaved rounds; one row per (prompt, K)."""
    rows = []
    for name, text in PROMPTS.items():
        ids = eng.tokenizer.encode_chat([{"role": "user", "content": text}])
        runs: list[int | None] = [None, *ks]
        for k in runs:
            run_once(eng, ids, 8, k)  # warm-up: arenas, caches
        walls: dict[int | None, list[float]] = {k: [] for k in runs}
        decode: dict[int | None, list[float]] = {k: [] for k in runs}
        last: dict[int | None, tuple[GenerationResult, LookupStats | None]] = {}
        for _ in range(rounds):
            for k in runs:
                res, wall, stats = run_once(eng, ids, new_tokens, k)
                walls[k].append(len(res.token_ids) / wall)
                decode[k].append(res.timings.decode_tokens_per_s)
                last[k] = (res, stats)
        plain = last[None][0]
        base = statistics.median(walls[None])
        for k in runs:
            res, stats = last[k]
            tps = statistics.median(walls[k])
            row = {"precision": precision, "prompt": name, "prompt_tokens": len(ids), "k": k,
                   "tokens": len(res.token_ids), "tokens_per_s": round(tps, 2),
                   "decode_tokens_per_s": round(statistics.median(decode[k]), 2),
                   "speedup": round(tps / base, 3), "identical": res.token_ids == plain.token_ids,
                   "rounds_tokens_per_s": [round(v, 2) for v in walls[k]]}
            if stats is not None:
                row.update(stats.to_dict())
                row["tokens_per_pass"] = round((len(res.token_ids) - 1) / max(1, stats.passes), 2)
            rows.append(row)
            label = "plain" if k is None else f"K={k}"
            print(f"{precision} {name:<16} {label:<6} {tps:6.1f} tok/s  x{tps / base:.2f}  "
                  f"accept {row.get('acceptance_rate', '-')}  identical {row['identical']}", flush=True)
    return rows


def median_ms(fn: Callable[[], Any], n: int) -> float:
    """Median milliseconds of ``n`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def profile_passes(layouts: Sequence[str], context: int, n: int) -> list[dict[str, Any]]:
    """Per KV layout (fp32): a one-token decode step, run_chunk of 1..11 tokens, truncate_cache; ``context``
    tokens already in the cache."""
    rows = []
    ids = list(np.random.default_rng(0).integers(100, 20000, context))
    for layout in layouts:
        with trtinfer.load(engine_dir("fp32", layout)) as eng:
            row = {"layout": layout, "context": context, **profile_session(eng.session, ids, n)}
        rows.append(row)
        print(f"profile {layout}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("_ms")), flush=True)
    return rows


def profile_session(s: Any, ids: list[int], n: int) -> dict[str, float]:
    """One session's pass costs after ``ids`` (ms): decode step, run_chunk of 1..11 tokens, truncate_cache."""
    cap = len(ids) + 64
    _, kv = s.run_chunk(ids, None, cap, positions=[len(ids) - 1])
    _, kv_dec = s.prefill([ids], cap)
    row = {"decode_ms": round(median_ms(lambda: s.decode(np.array([5]), kv_dec), n), 2)}
    for fed in (1, 2, 4, 6, 11):
        row[f"run_chunk_{fed}_ms"] = round(median_ms(
            lambda fed=fed: s.run_chunk(ids[:fed], kv, cap, positions=list(range(fed))), n), 2)
    _, grown = s.run_chunk(ids[:11], kv, cap, positions=[0])
    row["truncate_ms"] = round(median_ms(lambda: s.truncate_cache(grown, len(ids) + 1), n), 3)
    return row


def chart(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    prompts = list(PROMPTS)
    ks = sorted({r["k"] for r in rows if r["k"] is not None})
    fig, axes = plt.subplots(1, len(precisions), figsize=(6 * len(precisions), 3.8), squeeze=False)
    width = 0.8 / len(ks)
    for ax, precision in zip(axes[0], precisions):
        for i, k in enumerate(ks):
            vals = [next((r["speedup"] for r in rows if r["precision"] == precision and r["prompt"] == p
                          and r["k"] == k), 0) for p in prompts]
            ax.bar([j + i * width for j in range(len(prompts))], vals, width, label=f"K={k}")
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.axhline(1.5, color="tab:red", linestyle="--", linewidth=1, label="target 1.5x (repeat passage)")
        ax.set_xticks([j + width * (len(ks) - 1) / 2 for j in range(len(prompts))], prompts, fontsize=8)
        ax.set_ylabel("tokens/s vs plain greedy")
        ax.set_title(f"SmolLM2-135M {precision}: prompt lookup speed-up", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int4"])
    ap.add_argument("--ks", nargs="+", type=int, default=[3, 5, 10])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile-layouts", nargs="*", default=["shared_buffer", "concat"])
    ap.add_argument("--profile-context", type=int, default=300, help="tokens in the cache when a pass is profiled")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()  # other work on the machine slows every column; recorded beside the numbers
    rows = []
    for precision in args.precisions:
        with trtinfer.load(engine_dir(precision)) as eng:
            rows += compare(eng, precision, args.ks, args.new_tokens, args.rounds)
    profile = profile_passes(args.profile_layouts, args.profile_context, 15) if args.profile_layouts else []

    print("\n| engine | prompt | new tokens | plain tok/s | " + " | ".join(f"K={k} tok/s (speed-up, accepted)"
                                                                   for k in args.ks) + " | same tokens |")
    print("|---|---|---|---|" + "---|" * len(args.ks) + "---|")
    for precision in args.precisions:
        for name in PROMPTS:
            sel = {r["k"]: r for r in rows if r["precision"] == precision and r["prompt"] == name}
            cells = [f"{sel[k]['tokens_per_s']:.1f} ({sel[k]['speedup']:.2f}x, {sel[k]['acceptance_rate']:.0%})"
                     for k in args.ks]
            same = all(r["identical"] for r in sel.values())
            print(f"| {precision} | {name} | {sel[None]['tokens']} | {sel[None]['tokens_per_s']:.1f} | "
                  + " | ".join(cells) + f" | {'yes' if same else 'NO'} |")
    if profile:
        print("\n| layout | context | decode step ms | " + " | ".join(f"run_chunk {n} ms" for n in (1, 2, 4, 6, 11))
              + " | truncate ms |")
        print("|---|---|---|" + "---|" * 5 + "---|")
        for p in profile:
            print(f"| {p['layout']} | {p['context']} | {p['decode_ms']} | "
                  + " | ".join(str(p[f"run_chunk_{n}_ms"]) for n in (1, 2, 4, 6, 11)) + f" | {p['truncate_ms']} |")
    RESULTS.mkdir(exist_ok=True)
    out = result_path("speculative")
    load = {"before": [round(v, 2) for v in load_before], "after": [round(v, 2) for v in os.getloadavg()]}
    out.write_text(json.dumps({"machine": machine_info(), "load_average_1_5_15_min": load,
                               "date": time.strftime("%Y-%m-%d"), "model": MODEL, "new_tokens": args.new_tokens,
                               "rounds": args.rounds, "prompts": PROMPTS, "rows": rows, "pass_profile": profile},
                              indent=2))
    chart(rows, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
