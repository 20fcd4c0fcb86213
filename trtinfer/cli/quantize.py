"""``trtinfer quantize OPTIMIZE_DIR -o DIR --precision P``: the quantize stage on its own.

Takes what ``trtinfer optimize`` wrote (an fp32 graph for a target) and writes a stage directory that
``trtinfer build`` takes. The quantization flags are shared with ``trtinfer build`` (:func:`add_quant_args`).
"""
from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from trtinfer.cli._flags import config_from_flags, path_arg

CALIBRATION_FLAGS = {"method": "--calibrator", "percentile": "--percentile", "source": "--calibration-data",
                     "num_samples": "--calibration-samples", "seq_len": "--calibration-seq-len",
                     "decode_steps": "--calibration-decode-steps", "cache_file": "--calibration-cache"}
QUANT_FLAGS = {"method": "--method", "block_size": "--block-size", "lm_head_bits": "--lm-head-bits",
               "keep_fp32": "--keep-fp32", "include": "--include", "exclude": "--exclude",
               "smooth_alpha": "--smooth-alpha"}


def smooth_alpha(text: str) -> float | None:
    """``--smooth-alpha``: a number, or ``none`` for no smoothing."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1] or 'none', got {text!r}") from None


def add_quant_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The quantization flags (``quantize`` and ``build`` share them); returns them (``build`` refuses them on
    precisions that are not quantized)."""
    group = p.add_argument_group("quantization (int4, int8, int8-static, gguf)")
    made: list[argparse.Action] = []

    class _Collect:  # the group's add_argument, keeping what it returns
        def add_argument(self, *names: str, **kw: Any) -> None:
            made.append(group.add_argument(*names, **kw))

    g = _Collect()
    g.add_argument("--method", default="gptq", help="int4: gptq (default, calibrated) or rtn (round to nearest)")
    g.add_argument("--block-size", type=int, default=None,
                   help="int4/int8 weight block along K (default 32; int4 for --target tensorrt: 128, or 64)")
    g.add_argument("--asymmetric", action="store_true",
                   help="int4: asymmetric blocks (slower; wrong on AVX2-only CPUs at batch 1, ORT #29853)")
    g.add_argument("--lm-head-bits", type=int, default=4, help="int4: LM head (and tied embedding) bits, 4 or 8")
    g.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="quantize only nodes whose name matches (glob or substring; repeatable)")
    g.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="leave matching nodes in fp32 (repeatable; 'lm_head' names the LM head)")
    g.add_argument("--calibration-data", default=None, metavar="FILE",
                   help="text or JSONL (one {\"text\": ...} per line) file; default: a built-in text")
    g.add_argument("--calibrator", default="minmax", help="int8-static: minmax, percentile or entropy")
    g.add_argument("--smooth-alpha", type=smooth_alpha, default=0.7, metavar="A|none",
                   help="int8-static: SmoothQuant migration strength (default 0.7; 'none' turns smoothing off)")
    g.add_argument("--percentile", type=float, default=99.99, help="percentile calibrator's percentile")
    g.add_argument("--calibration-samples", type=int, default=16, help="windows of calibration text")
    g.add_argument("--calibration-seq-len", type=int, default=128, help="tokens per calibration window")
    g.add_argument("--calibration-decode-steps", type=int, default=8, help="decode steps after each window")
    g.add_argument("--calibration-cache", default=None, metavar="FILE",
                   help="reuse a calibration.json / calibration.cache instead of calibrating")
    return made


def quant_config(args: argparse.Namespace, precision: str, keep_fp32: tuple[str, ...]) -> Any:
    """The QuantConfig the flags describe (errors named by flag)."""
    from trtinfer.calibration import CalibrationConfig
    from trtinfer.quantization import QuantConfig

    cal = config_from_flags(CalibrationConfig, CALIBRATION_FLAGS, method=args.calibrator, percentile=args.percentile,
                            source=args.calibration_data, num_samples=args.calibration_samples,
                            seq_len=args.calibration_seq_len, decode_steps=args.calibration_decode_steps,
                            cache_file=args.calibration_cache)
    return config_from_flags(QuantConfig, QUANT_FLAGS, precision=precision, method=args.method,
                             block_size=args.block_size, symmetric=not args.asymmetric,
                             lm_head_bits=args.lm_head_bits, keep_fp32=keep_fp32, include=tuple(args.include),
                             exclude=tuple(args.exclude), calibration=cal, smooth_alpha=args.smooth_alpha)


def add_parser(sub: Any) -> None:
    """Register the verb."""
    from trtinfer.quantization.config import PRECISIONS

    p = sub.add_parser("quantize", help="quantize an optimized fp32 graph (int4, int8, int8-static, gguf)")
    p.add_argument("input", type=path_arg, help="directory from `trtinfer optimize` (fp32)")
    p.add_argument("-o", "--output", type=path_arg, required=True, help="stage directory to write (`trtinfer build` takes it)")
    p.add_argument("--precision", required=True, choices=PRECISIONS)
    p.add_argument("--keep-fp32", default="", metavar="PATTERNS",
                   help="comma-separated node-name patterns left in fp32 ('lm_head' names the LM head)")
    add_quant_args(p)
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--json", action="store_true", help="print the quantize record as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.cli.build import groups
    from trtinfer.quantization.accuracy import accuracy_text
    from trtinfer.quantization.stage import quantize_stage

    cfg = quant_config(args, args.precision, groups(args.keep_fp32))
    out = quantize_stage(args.input, args.output, cfg, overwrite=args.force, progress=not args.quiet)
    rec = out.history["quantize"]
    if args.json:
        print(json.dumps(rec, indent=2))
        return 0
    print(f"quantized {out.path}: {quant_summary(rec)} in {rec['seconds']:.1f} s")
    print(accuracy_text(rec.get("accuracy")))
    print(f"next: trtinfer build {shlex.quote(str(out.path))} -o ENGINE --precision {args.precision}")
    return 0


def quant_summary(rec: dict[str, Any]) -> str:
    """``int4 (gptq): 210/211 MatMuls, 4-bit block 32 symmetric x210, ...; weights 538 -> 77 MB`` for a person."""
    cfg, rep = rec["config"], rec.get("report", {})
    head = cfg["precision"] + (f" ({cfg['method']})" if "method" in cfg else "")
    forms = ", ".join(f"{k} x{v}" for k, v in (rep.get("forms") or {}).items())
    parts = [head]
    if "quantized" in rep and "matmuls" in rep:
        parts.append(f"{rep['quantized']}/{rep['matmuls']} MatMuls" + (f" ({forms})" if forms else ""))
    if rep.get("counts") and "quantized" not in rep:  # gguf: what each GGUF type became
        parts.append(", ".join(f"{k} x{v}" for k, v in rep["counts"].items()))
        if rep.get("kept_float"):
            parts.append(f"kept float: {len(rep['kept_float'])}")
    if rep.get("bytes_before") and rep.get("bytes_after"):
        parts.append(f"weights {rep['bytes_before'] / 2**20:.0f} -> {rep['bytes_after'] / 2**20:.0f} MiB")
    if rep.get("embedding"):
        parts.append(f"embedding: {rep['embedding']}")
    if rep.get("weight_bytes") and rep.get("weight_bytes_fp32"):
        parts.append(f"weights {rep['weight_bytes_fp32'] / 2**20:.0f} -> {rep['weight_bytes'] / 2**20:.0f} MiB")
    if rep.get("calibration"):
        c = rep["calibration"]
        what = c.get("method") or f"GPTQ statistics, {c.get('samples')} samples"
        parts.append(f"calibration {what} ({'reused' if c.get('reused') else 'computed'})")
    if rep.get("fallback"):
        f = rep["fallback"]
        parts.append(f"kept fp32: {', '.join(f['kept_fp32'])} ({f['because']})")
    return "; ".join(parts)
