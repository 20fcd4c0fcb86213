"""Produce README's benchmark table: trtinfer engines vs PyTorch eager, same machine, same run.

usage: python benchmarks/run_benchmarks.py [--models smollm2-135m gemma-3-270m] [--batch-sizes 1 8]
Prints a table and writes benchmarks/results/cpu.json (with the CPU model and its kernel-relevant flags). Engines
are built (every stage from the cache when present) under benchmarks/.engines. Peer figures (optimum, onnxruntime-genai, llama.cpp) come from ../shared/ANCHORS.md,
measured on the same class of machine; compare ratios against eager, not absolute times.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trtinfer.bench import compare
from trtinfer.builder import build

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma-3-270m"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu.json"))
    args = ap.parse_args()

    rows = []
    for model in args.models:
        engine = Path(__file__).parent / ".engines" / f"{model}-fp32-cpu"
        build(model, engine, overwrite=True, progress=False)
        for bs in args.batch_sizes:
            rep = compare(engine, bs, args.prompt_len, args.new_tokens)
            eng, eager = rep["results"]
            rows.append({"model": model, "batch_size": bs, "trtinfer": eng, "eager": eager,
                         "ratios_vs_eager": rep["ratios_vs_eager"]})
            q = rep["ratios_vs_eager"]
            print(f"{model:<14} bs{bs}: decode {eng['decode_tok_s']:7.1f} tok/s vs eager {eager['decode_tok_s']:6.1f} "
                  f"(x{q['decode']:.2f}); TTFT {eng['ttft_ms']:7.1f} ms vs {eager['ttft_ms']:7.1f} (x{q['ttft']:.2f}); "
                  f"peak {eng['peak_rss_mib']:.0f} vs {eager['peak_rss_mib']:.0f} MiB; same first tokens "
                  f"{q['same_first_tokens']}", flush=True)

    print("\n| model | bs | trtinfer TTFT ms | eager TTFT ms | trtinfer decode tok/s | eager decode tok/s "
          "| decode × eager | TTFT × eager | peak MiB (trtinfer / eager) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, g, q = r["trtinfer"], r["eager"], r["ratios_vs_eager"]
        print(f"| {r['model']} | {r['batch_size']} | {e['ttft_ms']:.0f} | {g['ttft_ms']:.0f} | {e['decode_tok_s']:.1f} "
              f"| {g['decode_tok_s']:.1f} | {q['decode']:.2f} | {q['ttft']:.2f} | "
              f"{e['peak_rss_mib']:.0f} / {g['peak_rss_mib']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
