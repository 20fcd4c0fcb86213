"""``trtinfer build MODEL|STAGE_DIR -o DIR``: model (or export/optimize output) to engine directory."""
from __future__ import annotations

import argparse
from typing import Any

from trtinfer.cli._flags import path_arg
from trtinfer.passes.config import DEFAULT_KEEP_FP32, KEEP_FP32_GROUPS


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("build", help="build an engine directory from MODEL")
    p.add_argument("model", type=path_arg, help="HF folder, .gguf file, alias (gemma-3-270m, smollm2-135m), or a directory from "
                                  "`trtinfer export` / `trtinfer optimize`")
    p.add_argument("-o", "--output", type=path_arg, required=True, help="engine directory to create")
    p.add_argument("--backend", default="onnxruntime",
                   help="engine backend: onnxruntime (default) or tensorrt (needs TensorRT >= 10.15 and a GPU)")
    p.add_argument("--precision", default="fp32",
                   help="fp32 (default), fp16 or bf16 (GPU targets), int4, int8, int8-static or gguf (quantized)")
    p.add_argument("--keep-fp32", default=None, metavar="GROUPS",
                   help=f"fp16/bf16: comma-separated groups computed in fp32 (of {', '.join(KEEP_FP32_GROUPS)}; "
                        f"default {','.join(DEFAULT_KEEP_FP32)}; '' for none); quantized precisions: node-name "
                        "patterns left in fp32 ('lm_head' names the LM head)")
    p.add_argument("--keep-io-types", action="store_true", help="fp16/bf16: keep KV inputs/outputs in fp32")
    p.add_argument("--disable-pass", action="append", default=[], metavar="PASS", help="skip a pass (repeatable)")
    p.add_argument("--target", default="cpu", choices=("cpu", "cuda"), help="execution provider to optimize for")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=None, help="default: min(model's max positions, 4096)")
    p.add_argument("--atol", type=float, default=1e-4, help="export validation tolerance")
    p.add_argument("--no-reduced-depth-check", action="store_true",
                   help="a model whose fp32 graph does not fit: skip the check on a build of its first 2 layers")
    p.add_argument("--max-perplexity-ratio", type=float, default=None, metavar="R",
                   help="quantized precisions: accept an engine whose perplexity on the held-out text is up to R x "
                        "the fp32 graph's (default per precision: int8 and int8-static 1.05, gguf 1.02, int4 1.15; "
                        "past it the build fails); the manifest records it")
    p.add_argument("--prefill", default=None, metavar="int8",
                   help="int8: CPU engines (fp32, int4, int8, gguf): add a prefill graph whose GEMMs run on int8 activations "
                        "and weights, 2-3x faster prompts for one int8 copy of the weights more in memory")
    trt = p.add_argument_group("TensorRT (--backend tensorrt)")
    tensorrt = [
        trt.add_argument("--opt-batch-size", type=int, default=None,
                         help="batch size the optimization profiles are tuned for (default: max batch size capped at 8)"),
        trt.add_argument("--opt-seq-len", type=int, default=None,
                         help="prompt length the prefill profile is tuned for (default: max seq len capped at 512)"),
        trt.add_argument("--workspace-mib", type=int, default=None, help="builder workspace limit in MiB (default 4096)"),
        trt.add_argument("--timing-cache", default=None, metavar="FILE",
                         help="timing cache file reused across builds (default: one per TensorRT version and GPU in "
                              "the trtinfer cache)")]
    p.add_argument("--force", action="store_true", help="replace an existing engine directory")
    from trtinfer.cli.quantize import add_quant_args

    quantized = add_quant_args(p)
    p.set_defaults(func=run, only_for={"tensorrt": tensorrt, "quantized": quantized})


def _refuse_unused(args: argparse.Namespace, quantized: bool) -> None:
    """A flag of a group that this build does not use (quantization flags on fp32, TensorRT's on ONNX Runtime, ...)
    is refused rather than silently ignored."""
    from trtinfer.errors import ConfigError
    from trtinfer.quantization.config import PRECISIONS as QUANTIZED

    used = {"tensorrt": args.backend == "tensorrt", "quantized": quantized}
    needs = {"tensorrt": "--backend tensorrt", "quantized": f"a quantized --precision ({', '.join(QUANTIZED)})"}
    for group, actions in args.only_for.items():
        given = [a.option_strings[-1] for a in actions if getattr(args, a.dest) != a.default]
        if given and not used[group]:
            raise ConfigError(f"{given[0]} applies to {needs[group]}, not this {args.backend} {args.precision} build; "
                              f"drop it", field=given[0])
    if args.keep_io_types and args.precision not in ("fp16", "bf16"):
        raise ConfigError(f"--keep-io-types applies to fp16/bf16 builds, not {args.precision}; drop it",
                          field="--keep-io-types")
    if args.keep_fp32 is not None and not quantized and args.precision not in ("fp16", "bf16"):
        raise ConfigError(f"--keep-fp32 applies to fp16/bf16 and quantized builds, not {args.precision} (all of it is "
                          "fp32 already); drop it", field="--keep-fp32")


def groups(text: str) -> tuple[str, ...]:
    """``"norms, softmax"`` -> ``("norms", "softmax")``."""
    return tuple(g.strip() for g in text.split(",") if g.strip())


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.artifact import read_manifest
    from trtinfer.builder import BuildConfig, build
    from trtinfer.cli.quantize import quant_config
    from trtinfer.cli.summary import fused_text, prefill_text, validation_text
    from trtinfer.export import ExportConfig
    from trtinfer.quantization.accuracy import accuracy_text
    from trtinfer.quantization.config import PRECISIONS as QUANTIZED

    _refuse_unused(args, args.precision in QUANTIZED)
    keep = groups(args.keep_fp32) if args.keep_fp32 is not None else None
    quant = quant_config(args, args.precision, keep or ()) if args.precision in QUANTIZED else None
    cfg = BuildConfig(backend=args.backend, precision=args.precision, target=args.target,
                      max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                      keep_io_types=args.keep_io_types,
                      keep_fp32=DEFAULT_KEEP_FP32 if keep is None or quant is not None else keep,
                      disable_passes=tuple(args.disable_pass), export=ExportConfig(atol=args.atol),
                      quantization=quant, opt_batch_size=args.opt_batch_size, opt_seq_len=args.opt_seq_len,
                      workspace_mib=args.workspace_mib, timing_cache=args.timing_cache,
                      max_perplexity_ratio=args.max_perplexity_ratio,
                      reduced_depth_check=not args.no_reduced_depth_check, prefill=args.prefill)
    out = build(args.model, args.output, cfg, overwrite=args.force, progress=not args.quiet)
    m = read_manifest(out).raw
    g = m["geometry"]
    stages = m.get("stages") or {}
    reused = [name for name, r in stages.items() if r.get("cached")]
    print(f"built {out} in {m['build_seconds']:.1f} s" + (f" (reused from cache: {', '.join(reused)})" if reused else ""))
    if m.get("kind") == "encoder":
        print(f"model: {m['architecture']} encoder, {g['num_layers']} layers, {m['backend']} {m['precision']}, "
              f"max batch {m['limits']['max_batch_size']}, max seq {m['limits']['max_seq_len']}, pooling "
              f"{m['pooling']['mode']}")
    else:
        print(f"model: {m['architecture']} {g['num_layers']} layers, {m['backend']}/{m['target']} {m['precision']}, "
              f"max batch {m['limits']['max_batch_size']}, max seq {m['limits']['max_seq_len']}, "
              f"KV layout {m['kv_layout']}")
    print(validation_text(m["export"]["validation"], m["export"].get("validation_skipped")))
    print("fused: " + fused_text(m.get("fused_ops", {})))
    q = m.get("quantization")
    if q:
        from trtinfer.cli.quantize import quant_summary

        print("quantized: " + quant_summary(q))
        print(accuracy_text(m.get("accuracy_check") or q.get("accuracy")))
    t = m.get("tensorrt")
    if t:
        print(f"tensorrt: {t['tensorrt_version']} on {t['gpu']} (sm {t['compute_capability']}), strongly typed "
              f"{t['precision']}, profiles " + ", ".join(p["name"] for p in t["profiles"]))
    c = m.get("engine_check")
    if c:
        print(f"engine check vs {c['reference']} ({c['precision']}): max|diff| {c['max_abs_diff']:.3g} <= "
              f"{c['tolerance']:g} x {c['logits_scale']:.3g}, top-1 agreement {c['top1_agreement']:.0%}")
    if m.get("prefill_check"):
        print(prefill_text(m["prefill_check"]))
    r = m.get("reduced_depth_check")
    if r:
        v, c, a = r["export_validation"] or {}, r["engine_check"] or {}, r.get("accuracy_check")
        print(f"checked on a reduced model, its first {r['layers']} of {g['num_layers']} layers and {r['vocab']} of "
              f"{g['vocab_size']} tokens (same weights; the whole model does not fit in fp32): export vs eager max|diff| {max(v.get('prefill_logits_max_abs_diff', 0), v.get('decode_logits_max_abs_diff', 0)):.3g}, "
              f"engine vs {c.get('reference', '?')} max|diff| {c.get('max_abs_diff', float('nan')):.3g} "
              f"(top-1 {c.get('top1_agreement', 0):.0%})"
              + (f", perplexity x{a['ratio']:.3f} vs fp32" if a else ""))
    for w in (m.get("fusion_report") or {}).get("warnings", []):
        print(f"warning: {w}")
    return 0
