"""``trtinfer build MODEL -o DIR``: one command from model to engine directory."""
from __future__ import annotations

import argparse
from typing import Any

from trtinfer.passes.config import DEFAULT_KEEP_FP32, KEEP_FP32_GROUPS


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("build", help="build an engine directory from MODEL")
    p.add_argument("model", help="HF folder, .gguf file, or alias (gemma-3-270m, smollm2-135m)")
    p.add_argument("-o", "--output", required=True, help="engine directory to create")
    p.add_argument("--backend", default="onnxruntime", help="engine backend (default: onnxruntime)")
    p.add_argument("--precision", default="fp32", help="fp32 (default), fp16 or bf16 (GPU targets)")
    p.add_argument("--keep-fp32", default=",".join(DEFAULT_KEEP_FP32), metavar="GROUPS",
                   help=f"fp16/bf16: comma-separated groups computed in fp32 (of {', '.join(KEEP_FP32_GROUPS)}; "
                        f"default {','.join(DEFAULT_KEEP_FP32)}; '' for none)")
    p.add_argument("--keep-io-types", action="store_true", help="fp16/bf16: keep KV inputs/outputs in fp32")
    p.add_argument("--disable-pass", action="append", default=[], metavar="PASS", help="skip a pass (repeatable)")
    p.add_argument("--target", default="cpu", choices=("cpu", "cuda"), help="execution provider to optimize for")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=None, help="default: min(model's max positions, 4096)")
    p.add_argument("--atol", type=float, default=1e-4, help="export validation tolerance")
    p.add_argument("--force", action="store_true", help="replace an existing engine directory")
    p.set_defaults(func=run)


def groups(text: str) -> tuple[str, ...]:
    """``"norms, softmax"`` -> ``("norms", "softmax")``."""
    return tuple(g.strip() for g in text.split(",") if g.strip())


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    import json

    from trtinfer.builder import BuildConfig, build
    from trtinfer.export import ExportConfig
    from trtinfer.runtime.manifest import read_manifest

    cfg = BuildConfig(backend=args.backend, precision=args.precision, target=args.target,
                      max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                      keep_io_types=args.keep_io_types, keep_fp32=groups(args.keep_fp32), disable_passes=tuple(args.disable_pass),
                      export=ExportConfig(atol=args.atol))
    out = build(args.model, args.output, cfg, overwrite=args.force, progress=not args.quiet)
    m = read_manifest(out).raw
    v = m["export"]["validation"] or {}
    print(f"built {out}: {m['architecture']} {m['geometry']['num_layers']} layers, {m['backend']} {m['precision']}, "
          f"max batch {m['limits']['max_batch_size']}, max seq {m['limits']['max_seq_len']}, "
          f"validation max|diff| {json.dumps(v.get('decode_logits_max_abs_diff'))}, {m['build_seconds']} s")
    fused = m.get("fused_ops", {})
    print("fused: " + ", ".join(f"{k} {c['count']}" + (f"/{c['expected']}" if c.get("expected") is not None else "")
                                for k, c in fused.items()) + f"; KV layout {m.get('kv_layout', 'concat')}")
    c = m.get("engine_check")
    if c:
        print(f"check vs export ({c['precision']}): max|diff| {c['max_abs_diff']:.3g} <= {c['tolerance']:g} x "
              f"{c['logits_scale']:.3g}, top-1 agreement {c['top1_agreement']:.0%}")
    for w in (m.get("fusion_report") or {}).get("warnings", []):
        print(f"warning: {w}")
    return 0
