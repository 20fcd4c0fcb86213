"""``trtinfer export MODEL -o DIR``: trace to ONNX, validate against eager, write the export stage directory."""
from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from trtinfer.cli._flags import path_arg


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("export", help="export MODEL to a validated ONNX graph with KV cache I/O (a stage directory)")
    p.add_argument("model", type=path_arg, help="HF folder, .gguf file, or alias (gemma-3-270m, smollm2-135m)")
    p.add_argument("-o", "--output", type=path_arg, required=True, help="output folder (must not exist unless --force)")
    p.add_argument("--opset", type=int, default=17)
    p.add_argument("--logits", choices=("last", "all"), default="last",
                   help="emit logits of the last position only (fast prefill) or of all positions")
    p.add_argument("--atol", type=float, default=1e-4, help="validation tolerance, scaled by max(1, max|logits|)")
    p.add_argument("--no-validate", action="store_true", help="skip the comparison with PyTorch eager")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--json", action="store_true", help="print the stage record as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.cli.summary import stage_summary
    from trtinfer.export import ExportConfig, export

    cfg = ExportConfig(opset=args.opset, logits=args.logits, atol=args.atol, validate=not args.no_validate)
    res = export(args.model, args.output, cfg, overwrite=args.force)
    if args.json:
        print(json.dumps(res.info, indent=2))
        return 0
    print(stage_summary(res))
    shown = shlex.quote(str(res.path))
    print(f"next: trtinfer optimize {shown} -o OPTIMIZED --target onnxruntime-cpu, or trtinfer build {shown} -o ENGINE")
    return 0
