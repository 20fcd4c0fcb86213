"""GPU benchmark: trtinfer engines on ONNX Runtime's CUDA provider (and TensorRT) vs PyTorch eager on the same GPU.

usage: python -m benchmarks.gpu [--models smollm2-135m gemma-3-270m] [--batch-sizes 1 8] [--precisions fp16 fp32]
                                [--eager-dtypes fp16 fp32] [--backends onnxruntime tensorrt]
                                [--prompt-len 128] [--new-tokens 64] [--out benchmarks/results/gpu.json]

For each model, engines are built for ``--target cuda`` in every ``--precisions`` (ONNX Runtime backend) and, when
TensorRT is importable and a GPU visible, an fp16 ``--backend tensorrt`` engine; otherwise the TensorRT rows are
skipped and the reason is printed and written. For each model and batch size, PyTorch eager (transformers
``generate``) is measured once per ``--eager-dtypes`` on the same GPU, and every engine is measured in the same run,
each in its own process (``trtinfer.bench``: TTFT, decode tok/s, host peak RSS, GPU memory and how it was measured).
Ratios are engine / eager for every eager dtype. Writes ``--out`` (default benchmarks/results/gpu.json: GPU name and
driver, onnxruntime/torch versions, CPU flags) and a chart beside it (``.png``). Without a CUDA GPU (onnxruntime
lacks CUDAExecutionProvider, or torch sees no device) it prints one line, writes nothing and exits 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info, result_path
from trtinfer.bench import EAGER_DTYPES, compare, measure_eager, nvidia_smi, ratios, smi_device
from trtinfer.errors import TrtInferError

HERE = Path(__file__).parent
BACKENDS = ("onnxruntime", "tensorrt")
TENSORRT_PRECISION = "fp16"  # the TensorRT rows: one precision, the one a GPU deployment picks
NO_GPU_EXIT = 2


def gpu_missing(backends: Sequence[str]) -> str | None:
    """Why this machine cannot run the benchmark (no CUDA provider in onnxruntime, no GPU for torch), or None."""
    if "onnxruntime" in backends:
        import onnxruntime as ort

        offered = ort.get_available_providers()
        if "CUDAExecutionProvider" not in offered:
            return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (it offers {', '.join(offered)}); "
                    "install onnxruntime-gpu on a machine with an NVIDIA GPU")
    try:
        import torch
    except ImportError:
        return "torch is not installed; the PyTorch eager baseline needs it with CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def tensorrt_unavailable() -> str | None:
    """Why TensorRT rows cannot be built here (the builder's own check: library, version, GPU), or None."""
    from trtinfer.builder.trt_backend import require_tensorrt
    from trtinfer.errors import BackendUnavailableError

    try:
        require_tensorrt()
    except BackendUnavailableError as e:
        return str(e)
    return None


def gpu_info(device_id: int = 0) -> dict[str, Any]:
    """GPU name, driver, memory and compute capability of CUDA device ``device_id`` (nvidia-smi, else cuda-python,
    else torch; ``source`` says which), and the library versions the figures depend on."""
    info: dict[str, Any] = {}
    lines = nvidia_smi("--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader",
                       "-i", smi_device(device_id))
    if lines:
        name, driver, memory, cc = (f.strip() for f in (lines[0].split(",") + ["", "", ""])[:4])
        info = {"gpu": name, "driver": driver, "memory_total": memory, "compute_capability": cc,
                "source": "nvidia-smi"}
    else:
        try:
            from cuda.bindings import runtime as rt

            from trtinfer.runtime.cuda import device_info

            _, driver_version = rt.cudaDriverGetVersion()
            info = {**device_info(device_id), "driver_cuda_version": int(driver_version), "source": "cuda-python"}
        except (ImportError, TrtInferError):
            import torch

            prop = torch.cuda.get_device_properties(device_id)
            info = {"gpu": prop.name, "memory_total": f"{prop.total_memory / 2**20:.0f} MiB",
                    "compute_capability": f"{prop.major}.{prop.minor}", "source": "torch"}
    return {**info, "versions": library_versions()}


def library_versions() -> dict[str, str | None]:
    """onnxruntime, torch (and its CUDA/cuDNN), transformers, TensorRT (None where not importable), trtinfer."""
    import onnxruntime
    import torch
    import transformers

    import trtinfer

    try:
        import tensorrt

        trt_version: str | None = getattr(tensorrt, "__version__", None)
    except ImportError:
        trt_version = None
    cudnn = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    return {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": None if cudnn is None else str(cudnn), "transformers": transformers.__version__,
            "tensorrt": trt_version, "trtinfer": trtinfer.__version__}


def engine_plan(precisions: Sequence[str], backends: Sequence[str], trt_ok: bool) -> list[tuple[str, str]]:
    """The ``(backend, precision)`` engines to build: every precision on ONNX Runtime, fp16 on TensorRT."""
    plan = [("onnxruntime", p) for p in precisions] if "onnxruntime" in backends else []
    if "tensorrt" in backends and trt_ok:
        plan.append(("tensorrt", TENSORRT_PRECISION))
    return plan


def build_engine(model: str, backend: str, precision: str) -> tuple[Path, dict[str, Any]]:
    """Build (stages from the cache) into benchmarks/.engines; returns the engine and what the build recorded."""
    from trtinfer.builder import BuildConfig, build  # here, not at the top: the no-GPU refusal stays quick

    config = (BuildConfig(backend="tensorrt", precision=precision) if backend == "tensorrt"
              else BuildConfig(target="cuda", precision=precision))
    engine = HERE / ".engines" / f"{model}-{precision}-{'tensorrt' if backend == 'tensorrt' else 'cuda'}"
    t0 = time.perf_counter()
    build(model, engine, config, overwrite=True, progress=False)
    manifest = json.loads((engine / "manifest.json").read_text())
    return engine, {"seconds": round(time.perf_counter() - t0, 1), "engine_check": manifest.get("engine_check")}


def engine_ratios(engine: dict[str, Any], eager: dict[str, Any]) -> dict[str, Any]:
    """:func:`trtinfer.bench.ratios`, plus ``gpu_used`` where both measured GPU memory the same way."""
    q = ratios(engine, eager)
    g, e = engine.get("gpu") or {}, eager.get("gpu") or {}
    if (g.get("used_mib") or 0) > 0 and (e.get("used_mib") or 0) > 0 and g.get("method") == e.get("method"):
        q["gpu_used"] = round(g["used_mib"] / e["used_mib"], 3)
    return q


def assemble_rows(engines: list[dict[str, Any]], eagers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per engine measurement, with its ratios against every eager dtype of the same model and batch.

    ``engines``: ``{"model", "batch_size", "backend", "precision", "result"}``; ``eagers``: ``{"model",
    "batch_size", "dtype", "result"}`` (results as :meth:`trtinfer.bench.BenchResult.to_dict` gives them).
    """
    rows = []
    for m in engines:
        same = [e for e in eagers if (e["model"], e["batch_size"]) == (m["model"], m["batch_size"])]
        rows.append({"model": m["model"], "batch_size": m["batch_size"], "backend": m["backend"],
                     "precision": m["precision"], "trtinfer": m["result"],
                     "ratios_vs_eager": {e["dtype"]: engine_ratios(m["result"], e["result"]) for e in same}})
    return rows


def _gpu_mib(result: dict[str, Any]) -> str:
    gpu = result.get("gpu") or {}
    used = "?" if gpu.get("used_mib") is None else f"{gpu['used_mib']:.0f}"
    alloc = gpu.get("torch_max_memory_allocated_mib")
    return used if alloc is None else f"{used} (alloc {alloc:.0f})"


def format_table(rows: list[dict[str, Any]], eagers: list[dict[str, Any]]) -> str:
    """A Markdown table: each model and batch size's eager rows, then its engines with ``x eager`` ratios.

    Ratios are engine / eager (decode: higher is better; TTFT: lower is better); ``same first tokens`` compares the
    first 8 greedy tokens with each eager dtype. GPU MiB: ``used_mib`` (method in the JSON); eager adds torch's
    ``max_memory_allocated`` as ``alloc``.
    """
    dtypes = list(dict.fromkeys(e["dtype"] for e in eagers))
    head = ["model", "system", "bs", "TTFT ms", "decode tok/s"]
    head += [f"decode × eager {d}" for d in dtypes] + [f"TTFT × eager {d}" for d in dtypes]
    head += ["GPU MiB", "host peak MiB", "same first tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = list(dict.fromkeys([(e["model"], e["batch_size"]) for e in eagers]
                                + [(r["model"], r["batch_size"]) for r in rows]))
    for model, bs in groups:
        for e in (e for e in eagers if (e["model"], e["batch_size"]) == (model, bs)):
            r = e["result"]
            cells = [model, f"PyTorch eager {e['dtype']}", str(bs), f"{r['ttft_ms']:.1f}", f"{r['decode_tok_s']:.1f}"]
            cells += ["–"] * (2 * len(dtypes)) + [_gpu_mib(r), f"{r['peak_rss_mib']:.0f}", "–"]
            lines.append("| " + " | ".join(cells) + " |")
        for row in (r for r in rows if (r["model"], r["batch_size"]) == (model, bs)):
            r, q = row["trtinfer"], row["ratios_vs_eager"]
            cells = [model, f"{row['backend']} {row['precision']}", str(bs), f"{r['ttft_ms']:.1f}",
                     f"{r['decode_tok_s']:.1f}"]
            cells += [f"{q[d]['decode']:.2f}" if d in q else "–" for d in dtypes]
            cells += [f"{q[d]['ttft']:.2f}" if d in q else "–" for d in dtypes]
            same = ", ".join(f"{d}: {'yes' if q[d]['same_first_tokens'] else 'no'}" for d in dtypes if d in q)
            cells += [_gpu_mib(r), f"{r['peak_rss_mib']:.0f}", same or "–"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], eagers: list[dict[str, Any]], path: Path, gpu_name: str) -> None:
    """Left: decode speed-up of each engine over eager in the first eager dtype; right: decode tok/s of every system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = eagers[0]["dtype"] if eagers else None
    groups = list(dict.fromkeys([(e["model"], e["batch_size"]) for e in eagers]
                                + [(r["model"], r["batch_size"]) for r in rows]))
    engines = list(dict.fromkeys(f"{r['backend']} {r['precision']}" for r in rows))
    systems = [f"eager {d}" for d in dict.fromkeys(e["dtype"] for e in eagers)] + engines

    def decode(g: tuple[str, int], system: str) -> float:
        for e in eagers:
            if (e["model"], e["batch_size"]) == g and f"eager {e['dtype']}" == system:
                return float(e["result"]["decode_tok_s"])
        for r in rows:
            if (r["model"], r["batch_size"]) == g and f"{r['backend']} {r['precision']}" == system:
                return float(r["trtinfer"]["decode_tok_s"])
        return 0.0

    def speedup(g: tuple[str, int], system: str) -> float:
        for r in rows:
            if (r["model"], r["batch_size"]) == g and f"{r['backend']} {r['precision']}" == system:
                return float(r["ratios_vs_eager"].get(ref, {}).get("decode", 0.0))
        return 0.0

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.8))
    labels = [f"{m}\nbs{b}" for m, b in groups]
    for ax, names, value, fmt in ((ax1, engines, speedup, "%.1f"), (ax2, systems, decode, "%.0f")):
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            bars = ax.bar([j + i * width for j in range(len(groups))], [value(g, name) for g in groups], width,
                          label=name)
            ax.bar_label(bars, fmt=fmt, fontsize=7)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(groups))], labels, fontsize=8)
        ax.margins(y=0.25)  # room for the legend above the tallest bar
        ax.legend(fontsize=8, loc="upper left", ncols=min(3, len(names)))
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel(f"decode tokens/s, x PyTorch eager {ref}")
    ax2.set_ylabel("decode tokens/s (all sequences of the batch)")
    fig.suptitle(f"trtinfer vs PyTorch eager on {gpu_name} (same GPU, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: the issue's grid)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma-3-270m"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--precisions", nargs="+", default=["fp16", "fp32"], help="ONNX Runtime engine precisions")
    ap.add_argument("--eager-dtypes", nargs="+", choices=sorted(EAGER_DTYPES), default=["fp16", "fp32"])
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(result_path("gpu")))
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid; 2 when no CUDA GPU is visible (one line, nothing written)."""
    args = parse_args(argv)
    missing = gpu_missing(args.backends)
    if missing:
        print(f"benchmarks/gpu.py: no CUDA GPU visible: {missing}; nothing measured or written", file=sys.stderr)
        return NO_GPU_EXIT

    skipped: list[dict[str, str]] = []
    trt_reason = tensorrt_unavailable() if "tensorrt" in args.backends else None
    if trt_reason:
        skipped.append({"backend": "tensorrt", "reason": trt_reason})
        print(f"TensorRT rows skipped: {trt_reason}", flush=True)
    plan = engine_plan(args.precisions, args.backends, trt_ok=trt_reason is None)
    builds: dict[str, Any] = {}
    failures: list[dict[str, str]] = []
    engines: list[dict[str, Any]] = []
    eagers: list[dict[str, Any]] = []
    for model in args.models:
        built: list[tuple[str, str, Path]] = []
        for backend, precision in plan:
            try:
                engine, record = build_engine(model, backend, precision)
            except TrtInferError as e:  # one engine that does not build leaves the others' rows
                failures.append({"what": f"build {model} {backend} {precision}", "error": str(e)})
                print(f"build {model} {backend} {precision} failed: {e}", flush=True)
                continue
            builds[f"{model}/{backend}/{precision}"] = record
            built.append((backend, precision, engine))
        if not built:
            continue
        for bs in args.batch_sizes:
            for dtype in args.eager_dtypes:  # the eager figures need only the source model: any engine names it
                try:
                    res = measure_eager(built[0][2], bs, args.prompt_len, args.new_tokens, "cuda", dtype).to_dict()
                except TrtInferError as e:
                    failures.append({"what": f"eager {model} {dtype} bs{bs}", "error": str(e)})
                    print(f"eager {model} {dtype} bs{bs} failed: {e}", flush=True)
                    continue
                eagers.append({"model": model, "batch_size": bs, "dtype": dtype, "result": res})
                print(f"{model:<14} eager {dtype:<4} bs{bs}: decode {res['decode_tok_s']:8.1f} tok/s, TTFT "
                      f"{res['ttft_ms']:7.1f} ms", flush=True)
            for backend, precision, engine in built:
                provider = "cuda" if backend == "onnxruntime" else None  # a TensorRT engine needs no provider
                try:
                    rep = compare(engine, bs, args.prompt_len, args.new_tokens, eager=False, provider=provider)
                except TrtInferError as e:
                    failures.append({"what": f"{model} {backend} {precision} bs{bs}", "error": str(e)})
                    print(f"{model} {backend} {precision} bs{bs} failed: {e}", flush=True)
                    continue
                res = rep["results"][0]
                engines.append({"model": model, "batch_size": bs, "backend": backend, "precision": precision,
                                "result": res})
                print(f"{model:<14} {backend} {precision:<4} bs{bs}: decode {res['decode_tok_s']:8.1f} tok/s, TTFT "
                      f"{res['ttft_ms']:7.1f} ms", flush=True)

    rows = assemble_rows(engines, eagers)
    print("\n" + format_table(rows, eagers))
    machine = {**machine_info(), "gpu": gpu_info()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len,
                               "new_tokens": args.new_tokens, "builds": builds, "eager": eagers, "rows": rows,
                               "skipped": skipped, "failures": failures}, indent=2))
    chart(rows, eagers, out.with_suffix(".png"), machine["gpu"].get("gpu", "GPU"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
