"""``trtinfer optimize IN.onnx -o OUT.onnx --target T``: run one pass pipeline on its own."""
from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    """Register the verb."""
    from trtinfer.passes.config import DEFAULT_KEEP_FP32, KEEP_FP32_GROUPS, PRECISIONS, TARGETS

    p = sub.add_parser("optimize", help="run a target's pass pipeline on an ONNX file")
    p.add_argument("input", nargs="?", help="ONNX file (a trtinfer export carries the geometry the fusions expect)")
    p.add_argument("-o", "--output", help="ONNX file to write (weights go to OUTPUT.data)")
    p.add_argument("--target", default="onnxruntime-cpu", choices=TARGETS)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--keep-fp32", default=",".join(DEFAULT_KEEP_FP32), metavar="GROUPS",
                   help=f"fp16/bf16: groups computed in fp32 (of {', '.join(KEEP_FP32_GROUPS)})")
    p.add_argument("--keep-io-types", action="store_true", help="fp16/bf16: keep graph inputs/outputs in fp32")
    p.add_argument("--max-seq-len", type=int, default=4096, help="positions the rotary caches cover")
    p.add_argument("--disable", action="append", default=[], metavar="PASS", help="skip a pass (repeatable)")
    p.add_argument("--list", action="store_true", help="list the pipelines and their passes, then exit")
    p.add_argument("--json", action="store_true", help="print the fusion report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.cli.build import groups
    from trtinfer.errors import ConfigError
    from trtinfer.passes import PIPELINES, PassConfig, optimize
    from trtinfer.passes.registry import all_passes

    if args.list:
        passes = all_passes()
        for target, names in PIPELINES.items():
            print(f"{target}:")
            for n in names:
                print(f"  {n:<18} {passes[n].kind:<10} {passes[n].doc}")
        return 0
    if not args.input or not args.output:
        raise ConfigError("give an input .onnx file and -o OUTPUT.onnx (or --list)")
    cfg = PassConfig(target=args.target, max_seq_len=args.max_seq_len, precision=args.precision,
                     keep_io_types=args.keep_io_types, keep_fp32=groups(args.keep_fp32), disable=tuple(args.disable))
    report = optimize(args.input, args.output, cfg)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 0
