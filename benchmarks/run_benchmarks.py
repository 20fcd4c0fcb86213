"""Produce README's benchmark tables: trtinfer engines (fp32 and quantized) vs PyTorch eager, one run, one machine.

usage: python -m benchmarks.run_benchmarks [--models smollm2-135m gemma-3-270m] [--batch-sizes 1 8]
                                           [--precisions fp32 int8 int4 gguf]

For each model and batch size, PyTorch eager fp32 is measured once and every engine precision is measured in its
own process in the same run (decode tok/s, TTFT, peak RSS of the process, load included). Perplexity: the first
``--ppl-tokens`` tokens of the held-out text shipped with trtinfer (GNU GPL v3), one window, scored by each engine
(``Engine.perplexity``) and by eager fp32 on the same token ids. Writes benchmarks/results/cpu.json (CPU model and
kernel-relevant flags included) and cpu.png. Engines are built under benchmarks/.engines (stages from the cache).
Peer figures (optimum, onnxruntime-genai, llama.cpp) come from ../shared/ANCHORS.md: compare ratios, not times.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info, result_path
from trtinfer.bench import compare
from trtinfer.builder import BuildConfig, build

HERE = Path(__file__).parent


def engine_perplexity(engine: Path, tokens: int) -> dict[str, Any]:
    """``trtinfer eval`` on the held-out text, in its own process (the engine's memory stays out of this one)."""
    from trtinfer.calibration import data

    text = Path(data.__file__).parent / "texts" / data.BUILTIN_TEXTS["gpl-3.0"]
    out = subprocess.run([sys.executable, "-m", "trtinfer", "eval", str(engine), "--text-file", str(text),
                          "--max-tokens", str(tokens), "--window", str(tokens), "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def eager_perplexity(engine: Path, tokens: int) -> float:
    """PyTorch eager fp32 perplexity of the engine's source model on the same token ids as :func:`engine_perplexity`."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtinfer.artifact import read_manifest
    from trtinfer.calibration.data import builtin_text
    from trtinfer.runtime.tokenizer import EngineTokenizer

    m = read_manifest(engine).raw
    ids = EngineTokenizer(engine, m.get("tokenizer", {})).encode(builtin_text("gpl-3.0"))[:tokens]
    model = AutoModelForCausalLM.from_pretrained(m["source"]["path"], dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])
    return math.exp(-float(lp.mean()))


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    """Decode speed-up over eager per model/batch/precision, and perplexity relative to eager."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    groups = list(dict.fromkeys((r["model"], r["batch_size"]) for r in rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(precisions)
    for i, p in enumerate(precisions):
        vals = [next((r["ratios_vs_eager"]["decode"] for r in rows if (r["model"], r["batch_size"]) == g
                      and r["precision"] == p), 0) for g in groups]
        bars = ax1.bar([j + i * width for j in range(len(groups))], vals, width, label=p)
        ax1.bar_label(bars, fmt="%.1f", fontsize=7)
    ax1.set_xticks([j + width * (len(precisions) - 1) / 2 for j in range(len(groups))],
                   [f"{m}\nbs{b}" for m, b in groups], fontsize=8)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("decode tokens/s, x PyTorch eager fp32")
    ax1.legend(fontsize=8)
    models = list(dict.fromkeys(r["model"] for r in rows))
    for i, p in enumerate(precisions):
        vals = [next((r["perplexity_vs_eager"] for r in rows if r["model"] == m and r["precision"] == p
                      and r.get("perplexity_vs_eager")), 0) for m in models]
        bars = ax2.bar([j + i * width for j in range(len(models))], vals, width, label=p)
        ax2.bar_label(bars, fmt="%.3f", fontsize=7)
    ax2.set_xticks([j + width * (len(precisions) - 1) / 2 for j in range(len(models))], models, fontsize=8)
    ax2.set_ylim(0.9, max(1.4, max((r.get("perplexity_vs_eager") or 1) for r in rows) + 0.05))
    ax2.set_ylabel("perplexity, x PyTorch eager fp32 (held-out text)")
    fig.suptitle("trtinfer on CPU vs PyTorch eager fp32 (same machine, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma-3-270m"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int8", "int4", "gguf"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--out", default=str(result_path("cpu")))
    args = ap.parse_args()

    rows: list[dict[str, Any]] = []
    builds: dict[str, Any] = {}
    for model in args.models:
        engines = {}
        for precision in args.precisions:
            engine = HERE / ".engines" / f"{model}-{precision}-cpu"
            t0 = time.perf_counter()
            build(model, engine, BuildConfig(precision=precision), overwrite=True, progress=False)
            engines[precision] = engine
            manifest = json.loads((engine / "manifest.json").read_text())
            builds[f"{model}/{precision}"] = {"seconds": round(time.perf_counter() - t0, 1),
                                              "quantization": manifest.get("quantization"),
                                              "engine_check": manifest.get("engine_check")}
        ppl_eager = eager_perplexity(engines[args.precisions[0]], args.ppl_tokens)
        ppl = {p: engine_perplexity(e, args.ppl_tokens)["perplexity"] for p, e in engines.items()}
        for bs in args.batch_sizes:
            eager = None
            for precision, engine in engines.items():
                rep = compare(engine, bs, args.prompt_len, args.new_tokens, eager=eager is None)
                eng = rep["results"][0]
                if eager is None:
                    eager = rep["results"][1]
                q = {"decode": round(eng["decode_tok_s"] / eager["decode_tok_s"], 3),
                     "ttft": round(eng["ttft_ms"] / eager["ttft_ms"], 3),
                     "peak_rss": round(eng["peak_rss_mib"] / eager["peak_rss_mib"], 3),
                     "same_first_tokens": eng["first_tokens"] == eager["first_tokens"]}
                rows.append({"model": model, "batch_size": bs, "precision": precision, "trtinfer": eng, "eager": eager,
                             "ratios_vs_eager": q, "perplexity": ppl[precision], "perplexity_eager": ppl_eager,
                             "perplexity_vs_eager": round(ppl[precision] / ppl_eager, 4)})
                print(f"{model:<14} {precision:<5} bs{bs}: decode {eng['decode_tok_s']:7.1f} tok/s vs eager "
                      f"{eager['decode_tok_s']:6.1f} (x{q['decode']:.2f}); TTFT {eng['ttft_ms']:7.1f} ms vs "
                      f"{eager['ttft_ms']:7.1f} (x{q['ttft']:.2f}); peak {eng['peak_rss_mib']:.0f} vs "
                      f"{eager['peak_rss_mib']:.0f} MiB; ppl {ppl[precision]:.3f} vs {ppl_eager:.3f} "
                      f"(x{ppl[precision] / ppl_eager:.3f})", flush=True)

    print("\n| model | precision | bs | TTFT ms (eager) | decode tok/s (eager) | decode × eager | TTFT × eager "
          "| peak MiB (eager) | perplexity × eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        e, g, q = r["trtinfer"], r["eager"], r["ratios_vs_eager"]
        print(f"| {r['model']} | {r['precision']} | {r['batch_size']} | {e['ttft_ms']:.0f} ({g['ttft_ms']:.0f}) | "
              f"{e['decode_tok_s']:.1f} ({g['decode_tok_s']:.1f}) | {q['decode']:.2f} | {q['ttft']:.2f} | "
              f"{e['peak_rss_mib']:.0f} ({g['peak_rss_mib']:.0f}) | {r['perplexity_vs_eager']:.3f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                               "perplexity_tokens": args.ppl_tokens, "builds": builds, "rows": rows}, indent=2))
    chart(rows, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
