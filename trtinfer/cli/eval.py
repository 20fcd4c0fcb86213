"""``trtinfer eval DIR --text-file F``: perplexity of a text file, scored by a decoder engine in sliding windows.

``--json`` prints exactly ``{"perplexity": float, "tokens": int}``; ``tokens`` is how many tokens were read from the
file (after ``--max-tokens``), of which all but the first are scored (with ``--stride`` equal to ``--window``,
each window's first token is not scored either).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trtinfer.cli._flags import add_cpu_runtime_flags, add_provider_flag, path_arg


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("eval", help="perplexity of a text file with a decoder engine")
    p.add_argument("engine", type=path_arg, help="decoder engine directory from `trtinfer build`")
    p.add_argument("--text-file", required=True, help="UTF-8 text file, tokenized as one sequence like tokenizer(text)")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the file's first N tokens (default: all)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per window (default and maximum: the engine's max sequence length)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: window // 2); each window scores only tokens no "
                        "earlier window scored, with up to window - stride tokens of context")
    p.add_argument("--json", action="store_true", help='print {"perplexity": float, "tokens": int}')
    add_provider_flag(p)
    add_cpu_runtime_flags(p)
    p.set_defaults(func=run)


def read_text_file(path: str) -> str:
    """The file's text; InputError (one line) when it is missing, unreadable, not UTF-8 or empty."""
    from trtinfer._files import read_text_file as read
    from trtinfer.errors import InputError

    text = read(path, "--text-file", "give a UTF-8 text file")
    if not text.strip():
        raise InputError(f"--text-file {path} is empty; give a file with some text to score")
    return text


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.artifact import read_manifest
    from trtinfer.cli._flags import RUNTIME_FLAGS, config_from_flags
    from trtinfer.errors import InputError
    from trtinfer.runtime.config import RuntimeConfig
    from trtinfer.runtime.engine import Engine

    # every flag is checked before the engine loads
    if args.max_tokens is not None and args.max_tokens < 2:
        raise InputError(f"--max-tokens must be at least 2 (the first token has no context), got {args.max_tokens}")
    if args.window is not None and args.window < 2:
        raise InputError(f"--window must be at least 2, got {args.window}")
    if args.stride is not None and not 1 <= args.stride <= (args.window or args.stride):
        raise InputError(f"--stride must be between 1 and the window, got {args.stride}")
    text = read_text_file(args.text_file)
    runtime = config_from_flags(RuntimeConfig, RUNTIME_FLAGS, provider=args.provider,
                                prefill_graph=args.prefill_graph, huge_pages=args.huge_pages,
                                spinning=args.spinning)
    manifest = read_manifest(Path(args.engine))
    if manifest.kind == "encoder":
        raise InputError(f"{args.engine} is an encoder engine; `trtinfer eval` needs a decoder engine")
    window = args.window or manifest.max_seq_len
    if window > manifest.max_seq_len:
        raise InputError(f"--window {window} exceeds the engine's max sequence length {manifest.max_seq_len}")
    if args.stride is not None and args.stride > window:
        raise InputError(f"--stride {args.stride} exceeds the window ({window} tokens)")
    with Engine(args.engine, runtime) as engine:
        ids = engine.tokenizer.encode(text)
        if len(ids) < 2:
            raise InputError(f"--text-file {args.text_file} gives {len(ids)} token(s); scoring needs at least 2")
        result = engine.perplexity(input_ids=ids, window=args.window, stride=args.stride, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps({"perplexity": result.perplexity, "tokens": result.tokens}))
        return 0
    print(f"perplexity {result.perplexity:.4f} over {result.tokens} tokens of {args.text_file} "
          f"({result.scored} scored; window {result.window}, stride {result.stride})")
    return 0
