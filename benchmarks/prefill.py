"""Time to first token against PyTorch eager, with and without the int8 prefill graph (``trtinfer build --prefill
int8``), for fp32 and int4 engines, in one run.

usage: python -m benchmarks.prefill [--models smollm2-135m,gemma-3-270m] [--precisions fp32,int4] [--prompt-len 128]

Builds each model at each precision twice (the second time with ``--prefill int8``; stages come from the cache),
then measures every engine and PyTorch eager fp32 with ``trtinfer.bench`` (each in its own process; TTFT is the best of
5 one-token calls, decode tok/s the best of 3 runs, peak RSS of the process), interleaved over ``--rounds`` rounds,
each system's best round kept. Accuracy: the build's own prefill check (held-out perplexity with the prefill graph over
the decoder graph alone) and, for int4, the engine's perplexity over the fp32 graph's. Prints a table, writes
benchmarks/results/prefill_<cpu>_<date>.json and a PNG chart beside it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.machine import git_commit, machine_info, result_path


def build(model: str, precision: str, prefill: bool, out: Path) -> dict[str, Any]:
    """``trtinfer build`` through the CLI; returns the manifest's checks."""
    cmd = [sys.executable, "-m", "trtinfer", "--quiet", "build", model, "--precision", precision, "-o", str(out)]
    subprocess.run(cmd + (["--prefill", "int8"] if prefill else []), check=True)
    m = json.loads((out / "manifest.json").read_text())
    return {"prefill_check": m.get("prefill_check"), "accuracy_check": m.get("accuracy_check"),
            "engine_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file())}


def measure(kind: str, engine: Path, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    from trtinfer.bench import measure_eager, measure_engine

    fn = measure_eager if kind == "eager" else measure_engine
    r = fn(engine, 1, prompt_len, new_tokens).to_dict()
    return {"ttft_ms": r["ttft_ms"], "decode_tok_s": r["decode_tok_s"], "peak_rss_mib": r.get("peak_rss_mib")}


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['model']}\n{r['system']}" for r in rows]
    ax.bar(range(len(rows)), [r["ttft_x_eager"] for r in rows],
           color=["gray" if r["system"] == "pytorch eager" else "tab:blue" if r["prefill"] else "tab:orange"
                  for r in rows])
    ax.axhline(0.5, color="red", linestyle="--", linewidth=1, label="0.5x eager")
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("TTFT / eager's TTFT")
    ax.set_title("128-token prompt, batch 1 (blue: --prefill int8)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--precisions", default="fp32,int4")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="trtinfer-prefill-"))
    rows: list[dict[str, Any]] = []
    try:
        for model in args.models.split(","):
            engines: list[tuple[str, bool, Path, dict[str, Any]]] = []
            for precision in args.precisions.split(","):
                for prefill in (False, True):
                    out = work / f"{model}-{precision}{'-prefill' if prefill else ''}"
                    engines.append((precision, prefill, out, build(model, precision, prefill, out)))
            systems = [("eager", False, engines[0][2], {}), *engines]
            best: dict[int, dict[str, Any]] = {}
            for _ in range(args.rounds):
                for i, (precision, _prefill, path, _info) in enumerate(systems):
                    got = measure("eager" if i == 0 else "engine", path, args.prompt_len, args.new_tokens)
                    was = best.setdefault(i, got)
                    best[i] = {"ttft_ms": min(was["ttft_ms"], got["ttft_ms"]),
                               "decode_tok_s": max(was["decode_tok_s"], got["decode_tok_s"]),
                               "peak_rss_mib": max(was["peak_rss_mib"] or 0, got["peak_rss_mib"] or 0)}
            eager_ttft = best[0]["ttft_ms"]
            for i, (precision, prefill, _path, info) in enumerate(systems):
                rows.append({"model": model, "system": "pytorch eager" if i == 0 else
                             f"trtinfer {precision}" + (" --prefill int8" if prefill else ""),
                             "precision": "fp32" if i == 0 else precision, "prefill": prefill, **best[i],
                             "ttft_x_eager": round(best[i]["ttft_ms"] / eager_ttft, 3), **info})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| model | system | TTFT ms | x eager | decode tok/s | peak MiB | prefill graph ppl x decoder's | "
          "ppl x fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        pc, acc = r.get("prefill_check") or {}, r.get("accuracy_check") or {}
        print(f"| {r['model']} | {r['system']} | {r['ttft_ms']:.1f} | {r['ttft_x_eager']:.2f} | "
              f"{r['decode_tok_s']:.1f} | {r['peak_rss_mib'] or 0:.0f} | "
              f"{pc.get('ratio', '-')} | {acc.get('ratio', '-')} |")
    report = {"machine": machine_info(), "commit": git_commit(), "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows}
    path = result_path("prefill")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    chart(rows, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
