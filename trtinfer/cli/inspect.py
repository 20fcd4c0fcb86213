"""``trtinfer inspect DIR``: manifest, I/O and op histogram of an engine."""
from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    """Register the verb."""
    p = sub.add_parser("inspect", help="show an engine's manifest, I/O and op histogram")
    p.add_argument("engine", help="engine directory")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=run)


def _shape(t: dict[str, Any]) -> str:
    return "[" + ", ".join(str(d) for d in t["shape"]) + "]"


def run(args: argparse.Namespace) -> int:
    """Run the verb."""
    from pathlib import Path

    from trtinfer.runtime.manifest import read_manifest

    m = read_manifest(Path(args.engine)).raw
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    g, lim = m["geometry"], m["limits"]
    if m.get("kind") == "encoder":
        fused = ", ".join(f"{k} {c['count']}/{c['expected']}" for k, c in m.get("fused_ops", {}).items())
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
    v = m["export"]["validation"]
    if v:
        print(f"validation   logits max|diff| prefill {v['prefill_logits_max_abs_diff']:.2e} decode "
              f"{v['decode_logits_max_abs_diff']:.2e} (tol {v['tolerance']:.2e}), present {v['present_max_abs_diff']:.2e}")
    q = m.get("quantization")
    if q:
        from trtinfer.cli.quantize import quant_summary
        from trtinfer.quantization.accuracy import accuracy_text

        print(f"quantized    {quant_summary(q)}")
        print(f"accuracy     {accuracy_text(q.get('accuracy')).removeprefix('accuracy ')}")
    c = m.get("engine_check")
    if c:
        print(f"engine check vs {c.get('reference', 'export')}: max|diff| {c['max_abs_diff']:.2e} (tol {c['tolerance']:g} x "
              f"{c['logits_scale']:.3g}), top-1 agreement {c['top1_agreement']:.0%}, "
              f"{'passed' if c['passed'] else 'FAILED'}")
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
        parts = []
        for fam, c in fused_ops.items():
            exp = c.get("expected")
            parts.append(f"{fam} {c['count']}" + (f"/{exp}" if exp is not None else ""))
        print("fused ops    " + ", ".join(parts))
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
