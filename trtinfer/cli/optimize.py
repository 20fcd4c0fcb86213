"""``trtinfer optimize EXPORT_DIR -o DIR --target T``: run a target's pass pipeline on its own.

Given an export stage directory it writes an optimize stage directory that ``trtinfer build`` takes; given a bare
``.onnx`` file it writes an ``.onnx`` file (no stage record: for graphs made elsewhere).
"""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from trtinfer.cli._flags import path_arg


def add_parser(sub: Any) -> None:
    """Register the verb."""
    from trtinfer.passes.config import DEFAULT_KEEP_FP32, KEEP_FP32_GROUPS, PRECISIONS, TARGETS

    p = sub.add_parser("optimize", help="run a target's pass pipeline on an export directory (or an ONNX file)")
    p.add_argument("input", type=path_arg, nargs="?", help="directory from `trtinfer export`, or an .onnx file")
    p.add_argument("-o", "--output", type=path_arg, help="directory to write (an .onnx path when the input is an .onnx file)")
    p.add_argument("--target", default="onnxruntime-cpu", choices=TARGETS)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--keep-fp32", default=",".join(DEFAULT_KEEP_FP32), metavar="GROUPS",
                   help=f"fp16/bf16: groups computed in fp32 (of {', '.join(KEEP_FP32_GROUPS)})")
    p.add_argument("--keep-io-types", action="store_true", help="fp16/bf16: keep graph inputs/outputs in fp32")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="positions the rotary caches cover (default: the model's, capped at 4096)")
    p.add_argument("--disable", action="append", default=[], metavar="PASS", help="skip a pass (repeatable)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--list", action="store_true", help="list the pipelines and their passes, then exit")
    p.add_argument("--json", action="store_true", help="print the fusion report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.artifact import is_stage_dir, read_stage
    from trtinfer.cli.build import groups
    from trtinfer.cli.summary import stage_summary
    from trtinfer.errors import ConfigError
    from trtinfer.passes import PIPELINES, PassConfig, optimize
    from trtinfer.passes.optimizer import optimize_stage
    from trtinfer.passes.registry import all_passes
    from trtinfer.stages import default_max_seq_len

    if args.list:
        passes = all_passes()
        for target, names in PIPELINES.items():
            print(f"{target}:")
            for n in names:
                print(f"  {n:<18} {passes[n].kind:<10} {passes[n].doc}")
        return 0
    if not args.input or not args.output:
        raise ConfigError("give an export directory (or an .onnx file) and -o OUTPUT (or --list)")
    if not Path(args.input).exists():
        raise ConfigError(f"{args.input} does not exist; give a directory from `trtinfer export` or an .onnx file")
    common = {"target": args.target, "precision": args.precision, "keep_io_types": args.keep_io_types,
              "keep_fp32": groups(args.keep_fp32), "disable": tuple(args.disable)}
    if is_stage_dir(args.input):
        stage = read_stage(args.input)
        max_seq = args.max_seq_len or default_max_seq_len(stage.geometry)
        out = optimize_stage(stage, args.output, PassConfig(max_seq_len=max_seq, **common), overwrite=args.force)
        if args.json:
            print(json.dumps(out.history["optimize"]["fusion_report"], indent=2))
        else:
            print(stage_summary(out))
            print(f"next: trtinfer build {shlex.quote(str(out.path))} -o ENGINE")
        return 0
    if Path(args.input).is_dir():
        raise ConfigError(f"{args.input} is a directory without stage.json: give a directory from `trtinfer export` "
                          "or an .onnx file")
    report = optimize(args.input, args.output, PassConfig(max_seq_len=args.max_seq_len or 4096, **common))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 0
