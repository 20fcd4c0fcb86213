"""``trtinfer inspect DIR``: manifest, I/O and op histogram of an engine; with ``--target tensorrt``, the nodes of a
stage's or an engine's graph TensorRT's ONNX parser would reject."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trtinfer.cli._flags import path_arg

CHECK_TARGETS = ("tensorrt",)


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser(
        "inspect", help="show an engine's manifest, I/O and op histogram, or check a graph for TensorRT",
        description="Show an engine's manifest, I/O and op histogram. With --target tensorrt, check the graph of an "
                    "export/optimize/quantize stage directory, an engine directory or an .onnx file against TensorRT's "
                    "ONNX parser (weights are not read) and print one line per rejected node: name, op, reason.",
        epilog="exit status with --target: 0 when TensorRT's parser takes every node, 1 when it would reject some, "
               "2 when DIR is not a stage, engine or .onnx file")
    p.add_argument("engine", type=path_arg, metavar="DIR", help="engine directory (with --target also a stage directory or .onnx file)")
    p.add_argument("--target", choices=CHECK_TARGETS,
                   help="list the nodes this target's parser would reject instead (exit 1 when there are any)")
    p.add_argument("--json", action="store_true", help="print the manifest (with --target: the rejected nodes) as JSON")
    p.set_defaults(func=run)


def _graph_path(path: Path) -> Path:
    """The ONNX graph of a stage directory, an engine directory, or ``path`` itself when it is an .onnx file."""
    from trtinfer.artifact import MANIFEST_NAME, is_stage_dir, read_manifest, read_stage
    from trtinfer.errors import ModelSourceError

    if path.is_file() and path.suffix == ".onnx":
        return path
    if is_stage_dir(path):  # stage.json only: hashing the files would read the weights
        return read_stage(path, verify=False).onnx_path
    if (path / MANIFEST_NAME).is_file():  # a TensorRT engine keeps the graph it was built from, without weights
        files = read_manifest(path).files
        graphs = [files[r] for r in ("network", "decoder", "encoder") if files.get(r, "").endswith(".onnx")]
        if graphs:
            return path / graphs[0]
        raise ModelSourceError(f"engine directory {path} holds no ONNX graph ({', '.join(files.values())}); check the "
                               "stage directory it was built from instead")
    found = "is not" if path.exists() else "does not exist; expected"
    raise ModelSourceError(f"{path} {found} a stage directory (stage.json), an engine directory ({MANIFEST_NAME}) "
                           "or an .onnx file; give one from `trtinfer optimize`, `trtinfer quantize` or `trtinfer build`")


def check_target(args: argparse.Namespace) -> int:
    """``--target tensorrt``: print the nodes TensorRT's parser would reject; 1 when there are any, else 0."""
    from dataclasses import asdict

    import onnx_ir as ir
    from google.protobuf.message import DecodeError

    from trtinfer.errors import ModelSourceError
    from trtinfer.passes.trt_support import TENSORRT_VERSION, iter_nodes, tensorrt_problems

    path = _graph_path(Path(args.engine))
    try:
        model = ir.load(str(path))  # the graph only: external weights stay on disk, mapped if a check reads one
    except (OSError, DecodeError) as e:
        given = Path(args.engine)
        again = "export it again" if path == given else f"export or build {given} again"
        raise ModelSourceError(f"{path} could not be read as ONNX ({e}); {again}") from e
    problems = tensorrt_problems(model)
    if args.json:
        print(json.dumps([asdict(p) for p in problems], indent=2))
        return 1 if problems else 0
    total = sum(1 for _ in iter_nodes(model))
    if not problems:
        print(f"TensorRT {TENSORRT_VERSION} parser: all {total} nodes supported")
        return 0
    wn, wo = max(len(p.node) for p in problems), max(len(p.op) for p in problems)
    for p in problems:
        print(f"{p.node:<{wn}}  {p.op:<{wo}}  {p.reason}")
    print(f"TensorRT {TENSORRT_VERSION} parser: {len({p.node for p in problems})} of {total} nodes rejected")
    return 1


def _shape(t: dict[str, Any]) -> str:
    return "[" + ", ".join(str(d) for d in t["shape"]) + "]"


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from trtinfer.artifact import read_manifest

    if args.target:
        return check_target(args)

    m = read_manifest(Path(args.engine)).raw
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    try:
        return _print(args, m)
    except (KeyError, TypeError, AttributeError) as e:  # a manifest that loads but lacks what this summary shows
        from trtinfer.errors import EngineLoadError

        raise EngineLoadError(f"{args.engine}/manifest.json lacks or mistypes {e} for the summary; rebuild the "
                              "engine, or read it whole with --json") from e


def _print(args: argparse.Namespace, m: dict[str, Any]) -> int:
    from trtinfer.cli.summary import fused_text

    g, lim = m["geometry"], m["limits"]
    if m.get("kind") == "encoder":
        fused = fused_text(m.get("fused_ops", {}))
        print(f"engine       {args.engine} (encoder)")
        print(f"model        {m['architecture']} from {m['source']['model']} sha256 {m['source']['sha256'][:16]}")
        print(f"geometry     {g['num_layers']} layers, {g['num_attention_heads']} heads, hidden {g['hidden_size']}")
        print(f"pooling      {m['pooling']['mode']}, normalize {m['pooling']['normalize']}, max seq {lim['max_seq_len']}")
        print(f"fused ops    {fused}")
        print("ops          " + ", ".join(f"{k} {v}" for k, v in m["op_histogram"].items()))
        return 0
    print(f"engine       {args.engine}")
    print(f"model        {m['architecture']} ({m['model_type']}) from {m['source']['model']} "
          f"sha256 {m['source']['sha256'][:16]}")
    print(f"backend      {m['backend']} / {m['target']} / {m['precision']}")
    print(f"geometry     {g['num_layers']} layers, {g['num_attention_heads']} heads, {g['num_kv_heads']} KV heads, "
          f"head dim {g['head_dim']}, vocab {g['vocab_size']}, sliding window {g['sliding_window']}")
    print(f"limits       max batch {lim['max_batch_size']}, max seq {lim['max_seq_len']}")
    t = m.get("tensorrt")
    if t:
        print(f"tensorrt     {t['tensorrt_version']} on {t['gpu']} (compute capability {t['compute_capability']}), "
              f"strongly typed {t['precision']}, workspace {t['workspace_mib']} MiB, timing cache {t['timing_cache']}")
        for prof in t["profiles"]:
            print(f"  profile {prof['name']:<8} " + ", ".join(f"{k} {lo}..{opt}..{hi}"
                                                           for k, (lo, opt, hi) in prof["dims"].items()))
    v = m["export"]["validation"]
    if v:
        print(f"validation   logits max|diff| prefill {v['prefill_logits_max_abs_diff']:.2e} decode "
              f"{v['decode_logits_max_abs_diff']:.2e} (tol {v['tolerance']:.2e}), present {v['present_max_abs_diff']:.2e}")
    q = m.get("quantization")
    if q:
        from trtinfer.cli.quantize import quant_summary
        from trtinfer.quantization.accuracy import accuracy_text

        print(f"quantized    {quant_summary(q)}")
        acc = m.get("accuracy_check") or q.get("accuracy")  # the engine's own check; older engines: the stage's
        print(f"accuracy     {accuracy_text(acc).removeprefix('accuracy ')}")
    c = m.get("engine_check")
    if c:
        print(f"engine check vs {c.get('reference', 'export')}: max|diff| {c['max_abs_diff']:.2e} (tol {c['tolerance']:g} x "
              f"{c['logits_scale']:.3g}), top-1 agreement {c['top1_agreement']:.0%}, "
              f"{'passed' if c['passed'] else 'FAILED'}")
    if m.get("prefill_check"):
        from trtinfer.cli.summary import prefill_text

        print(prefill_text(m["prefill_check"]))
    ins, outs = m["io"]["inputs"], m["io"]["outputs"]
    print("inputs")
    for t in ins[:5]:
        print(f"  {t['name']:<32} {t['dtype']:<8} {_shape(t)}")
    if len(ins) > 5:
        print(f"  ... {len(ins) - 5} more past_key_values inputs")
    print("outputs")
    for t in outs[:3]:
        print(f"  {t['name']:<32} {t['dtype']:<8} {_shape(t)}")
    if len(outs) > 3:
        print(f"  ... {len(outs) - 3} more present outputs")
    fused_ops: dict[str, Any] = m.get("fused_ops") or {}
    if fused_ops:
        print(f"kv layout    {m.get('kv_layout', 'concat')}")
        print("fused ops    " + fused_text(fused_ops))  # the same line as `trtinfer build` prints
        rep = m.get("fusion_report") or {}
        fired = [f"{n} {r['fired']}" + (f"/{r['expected']}" if r.get("expected") is not None else "")
                 for n, r in rep.get("fusions", {}).items() if r["kind"] == "fusion"]
        if fired:
            print(f"passes       ({rep.get('target')}) " + ", ".join(fired))
        for w in rep.get("warnings", []):
            print(f"warning      {w}")
    print("ops          " + ", ".join(f"{k} {v}" for k, v in m["op_histogram"].items()))
    print("versions     " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    return 0
