"""trtinfer engines, PyTorch eager and the peers (onnxruntime-genai, optimum-onnx, llama.cpp) in one run, one machine.

usage: python -m benchmarks.vs_peers [--models smollm2-135m] [--batch-sizes 1 8] [--rounds 2]
           [--oga-python VENV/bin/python] [--optimum-python VENV/bin/python] [--llama-cpp-python VENV/bin/python]

Each peer runs in its own venv (their pins clash with ours: optimum-onnx wants transformers < 4.58), named by the
interpreter that holds it; a peer without an interpreter is left out of the table. ``benchmarks/peer_workers/setup.sh``
makes the three venvs. Every system gets the same 128 prompt token ids (the engine's tokenizer; all peers read the
same vocabulary) and runs in its own process with the rule of ``trtinfer.bench`` (TTFT: best of 5 one-token calls;
decode tok/s: every row of the batch, tokens after the first over the time after it, best of 3). ``--rounds`` repeats
the whole sequence of systems and keeps each system's best round (this shared 2-core machine drifts over minutes).

Peer models are made once and kept under ``$TRTINFER_CACHE/peers`` (default ``~/.cache/trtinfer/peers``), keyed by
the source model's hash: onnxruntime-genai's model builder (int4 = its default RTN block-32 recipe, and fp32) and
optimum-onnx's export read the same dequantized Hugging Face folder our export read; llama.cpp reads the GGUF file.
Writes benchmarks/results/vs_peers.json (CPU model and flags included) and vs_peers.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import machine_info, result_path
from trtinfer.artifact import read_manifest
from trtinfer.bench import _prompt_ids, measure_eager, measure_engine
from trtinfer.builder import BuildConfig, build
from trtinfer.errors import TrtInferError
from trtinfer.export.sources import ALIASES

HERE = Path(__file__).parent
WORKERS = HERE / "peer_workers"
OURS = ("fp32", "int4", "gguf")


def peer_cache() -> Path:
    return Path(os.environ.get("TRTINFER_CACHE", Path.home() / ".cache" / "trtinfer")) / "peers"


def _made_once(out: Path, make: Any) -> Path:
    """``make(tmp_dir)`` into a temp dir renamed to ``out`` at the end (a failed make leaves nothing behind)."""
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        make(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"{what} failed: {tail}")


def oga_model(python: str, src: Path, sha: str, precision: str) -> Path:
    def make(tmp: Path) -> None:
        _run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(tmp), "-p", precision,
              "-e", "cpu", "-c", str(tmp / "_cache")], f"onnxruntime-genai's builder ({precision})")
        shutil.rmtree(tmp / "_cache", ignore_errors=True)
    return _made_once(peer_cache() / f"oga-{precision}-{sha[:16]}", make)


def optimum_model(python: str, src: Path, sha: str) -> Path:
    cli = str(Path(python).parent / "optimum-cli")
    return _made_once(peer_cache() / f"optimum-fp32-{sha[:16]}",
                      lambda tmp: _run([cli, "export", "onnx", "--model", str(src), "--task",
                                        "text-generation-with-past", str(tmp)], "optimum-cli export onnx"))


def peer(python: str, worker: str, model: Path, ids_file: Path, bs: int, new_tokens: int) -> dict[str, Any]:
    proc = subprocess.run([python, str(WORKERS / worker), "--model", str(model), "--ids", str(ids_file),
                           "--bs", str(bs), "--new-tokens", str(new_tokens)], check=False, capture_output=True,
                          text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode:
        tail = (proc.stderr.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"{worker} failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def systems(args: argparse.Namespace, model: str) -> tuple[Path, list[tuple[str, Any]]]:
    """The engines (built or from the cache) and a measuring function per system, eager first."""
    engines = {}
    for p in OURS:
        engines[p] = HERE / ".engines" / f"{model}-{p}-cpu"
        build(model, engines[p], BuildConfig(precision=p), overwrite=True, progress=False)
    ref = engines["fp32"]
    src = read_manifest(ref).raw["source"]
    src_dir, sha = Path(src["path"]), src["sha256"]
    out: list[tuple[str, Any]] = [("PyTorch eager fp32", lambda bs, n: measure_eager(ref, bs, 128, n).to_dict())]
    out += [(f"trtinfer {p}", lambda bs, n, e=engines[p]: measure_engine(e, bs, 128, n).to_dict()) for p in OURS]
    ids_file = peer_cache() / f"prompt-{sha[:16]}-128.json"  # the ids every peer is fed
    ids_file.parent.mkdir(parents=True, exist_ok=True)
    ids_file.write_text(json.dumps(_prompt_ids(ref, 128)))
    if args.oga_python:
        for p in ("fp32", "int4"):
            try:
                m = oga_model(args.oga_python, src_dir, sha, p)
            except RuntimeError as e:  # e.g. its builder does not know Gemma-3's rope settings
                out.append((f"onnxruntime-genai {p}", str(e)))
                continue
            out.append((f"onnxruntime-genai {p}",
                        lambda bs, n, m=m: peer(args.oga_python, "run_oga.py", m, ids_file, bs, n)))
    if args.optimum_python:
        try:
            m = optimum_model(args.optimum_python, src_dir, sha)
            out.append(("optimum-onnx fp32", lambda bs, n, m=m: peer(args.optimum_python, "run_optimum.py", m, ids_file,
                                                                   bs, n)))
        except RuntimeError as e:
            out.append(("optimum-onnx fp32", str(e)))
    if args.llama_cpp_python:
        gguf = ALIASES[model]()
        out.append(("llama.cpp (the GGUF's own blocks)",
                    lambda bs, n: peer(args.llama_cpp_python, "run_llama_cpp.py", gguf, ids_file, bs, n) if bs == 1
                    else "batch 1 only (llama-cpp-python)"))
    return ref, out


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model"], r["batch_size"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (model, bs) in zip(axes[0], groups):
        rs = [r for r in rows if (r["model"], r["batch_size"]) == (model, bs) and r.get("decode_x_eager")]
        bars = ax.barh([r["system"] for r in rs], [r["decode_x_eager"] for r in rs],
                       color=["tab:blue" if r["system"].startswith("trtinfer") else "tab:grey" for r in rs])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.invert_yaxis()
        ax.set_title(f"{model}, batch {bs}", fontsize=10)
        ax.set_xlabel("decode tokens/s, x PyTorch eager fp32 (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--oga-python", help="interpreter of a venv with onnxruntime-genai")
    ap.add_argument("--optimum-python", help="interpreter of a venv with optimum-onnx[onnxruntime]")
    ap.add_argument("--llama-cpp-python", help="interpreter of a venv with llama-cpp-python")
    ap.add_argument("--out", default=str(result_path("vs_peers")))
    args = ap.parse_args()
    for flag in ("oga_python", "optimum_python", "llama_cpp_python"):
        path = getattr(args, flag)
        if path and not (Path(path).is_file() and os.access(path, os.X_OK)):
            sys.exit(f"--{flag.replace('_', '-')} {path}: not an executable interpreter; make the venvs with "
                     "benchmarks/peer_workers/setup.sh or leave the flag out")
    rows: list[dict[str, Any]] = []
    for model in args.models:
        _, measured = systems(args, model)
        for bs in args.batch_sizes:
            best: dict[str, dict[str, Any] | str] = {}
            for rnd in range(args.rounds):
                for name, fn in measured:
                    if isinstance(fn, str):
                        best[name] = fn
                        continue
                    try:
                        r = fn(bs, args.new_tokens)
                    except (RuntimeError, TrtInferError, ValueError) as e:  # a system that fails is a row saying so
                        r = f"failed: {e}"
                    prev = best.get(name)
                    if isinstance(r, str):
                        best.setdefault(name, r)
                    elif not isinstance(prev, dict):
                        best[name] = r
                    else:  # each figure's best round
                        best[name] = {**prev, "decode_tok_s": max(prev["decode_tok_s"], r["decode_tok_s"]),
                                      "ttft_ms": min(prev["ttft_ms"], r["ttft_ms"]),
                                      "peak_rss_mib": min(prev["peak_rss_mib"], r["peak_rss_mib"])}
                    got = best[name]
                    print(f"round {rnd + 1} {model} bs{bs} {name}: "
                          + (got if isinstance(got, str) else
                             f"{got['decode_tok_s']:.1f} tok/s, TTFT {got['ttft_ms']:.0f} ms"), flush=True)
            eager = best["PyTorch eager fp32"]
            if not isinstance(eager, dict):
                sys.exit(f"{model} bs{bs}: PyTorch eager, the baseline of every ratio, did not run: {eager}")
            for name, r in best.items():
                row: dict[str, Any] = {"model": model, "batch_size": bs, "system": name}
                if isinstance(r, str):
                    row["not_measured"] = r
                else:
                    row.update(result=r, decode_x_eager=round(r["decode_tok_s"] / eager["decode_tok_s"], 2),
                               ttft_x_eager=round(r["ttft_ms"] / eager["ttft_ms"], 2),
                               same_first_tokens=r["first_tokens"] == eager["first_tokens"])
                rows.append(row)
    print("\n| model | bs | system | decode tok/s | × eager | TTFT ms | × eager | peak MiB | first 8 tokens = eager |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "not_measured" in r:
            print(f"| {r['model']} | {r['batch_size']} | {r['system']} | – | – | – | – | – | {r['not_measured']} |")
            continue
        x = r["result"]
        print(f"| {r['model']} | {r['batch_size']} | {r['system']} | {x['decode_tok_s']:.1f} | {r['decode_x_eager']:.2f} "
              f"| {x['ttft_ms']:.0f} | {r['ttft_x_eager']:.2f} | {x['peak_rss_mib']:.0f} | "
              f"{'yes' if r['same_first_tokens'] else 'no'} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "prompt_len": 128,
                               "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows}, indent=2))
    chart(rows, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
