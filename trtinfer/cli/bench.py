"""``trtinfer bench DIR``: TTFT, decode tokens/s and peak memory of an engine and of PyTorch eager."""
from __future__ import annotations

import argparse
import json
from typing import Any

from trtinfer.cli._flags import path_arg


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("bench", help="benchmark an engine against PyTorch eager on the same model")
    p.add_argument("engine", type=path_arg, help="engine directory")
    p.add_argument("-b", "--batch-size", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-eager", action="store_true", help="skip the PyTorch eager baseline")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.bench import compare, format_table

    report = compare(args.engine, args.batch_size, args.prompt_len, args.new_tokens, eager=not args.no_eager)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0
