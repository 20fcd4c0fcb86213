"""``trtinfer embed DIR --text ...``: sentence embeddings from an encoder engine."""
from __future__ import annotations

import argparse
import json
from typing import Any

from trtinfer.cli._flags import path_arg


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("embed", help="print sentence embeddings from an encoder engine")
    p.add_argument("engine", type=path_arg, help="encoder engine directory (trtinfer build all-minilm-l6-v2 -o DIR)")
    p.add_argument("--text", action="append", required=True, help="a text to embed (repeatable)")
    p.add_argument("--json", action="store_true", help="print full vectors as JSON")
    p.add_argument("--no-normalize", action="store_true", help="skip L2 normalization even if the model uses it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.artifact import read_manifest
    from trtinfer.cli._flags import check_text_flag
    from trtinfer.errors import InputError
    from trtinfer.runtime.encoder import EncoderEngine

    check_text_flag("--text", args.text)  # before loading: the tokenizer would fail on undecodable bytes
    if read_manifest(args.engine).kind != "encoder":
        raise InputError(f"{args.engine} is a decoder engine; `trtinfer embed` needs an encoder engine "
                         "(e.g. trtinfer build all-minilm-l6-v2 -o DIR)")
    from trtinfer.runtime.config import RuntimeConfig

    eng = EncoderEngine(args.engine, RuntimeConfig(huge_pages=False))  # one-off, as generate: the faster load
    vecs = eng.embed(args.text, normalize=False if args.no_normalize else None)
    if args.json:
        print(json.dumps([{"text": t, "embedding": [round(float(x), 6) for x in v]} for t, v in zip(args.text, vecs)]))
        return 0
    for t, v in zip(args.text, vecs):
        head = " ".join(f"{x:+.4f}" for x in v[:6])
        print(f"[{len(v)}] {head} ...  {t[:60]}")
    return 0
