"""One-line human summaries of stage directories and engine manifests, shared by the verbs that print them."""
from __future__ import annotations

from typing import Any


def validation_text(v: dict[str, Any] | None, skipped: str | None = None) -> str:
    """``validated vs eager: max|diff| 2.1e-05 (tol 3.0e-03), top-1 agrees`` (decoder or encoder record)."""
    if not v:
        return f"not validated against eager ({skipped})" if skipped else "not validated against eager"
    if "decode_logits_max_abs_diff" in v:
        diff = max(v["prefill_logits_max_abs_diff"], v["decode_logits_max_abs_diff"])
        from trtinfer.export.validate import vocab_scope

        return (f"validated vs eager: logits max|diff| {diff:.2e} (tol {v['tolerance']:.2e}){vocab_scope(v)}, "
                "top-1 agrees")
    return f"validated vs eager: max|diff| {v['max_abs_diff']:.2e} (tol {v['tolerance']:.2e})"


def fused_text(fused: dict[str, Any]) -> str:
    """A manifest's ``fused_ops`` in one line, as ``build`` and ``inspect`` print it: ``attention 30/30, rotary
    60/60, norm 61/61``; a family the passes fused but the engine graph holds differently says so:
    ``gelu 0/18 (the passes fused 18; the backend expanded them again)``."""
    parts = []
    for k, c in fused.items():
        if not (c["count"] or c.get("expected") or c.get("by_passes")):
            continue
        text = f"{k} {c['count']}" + (f"/{c['expected']}" if c.get("expected") is not None else "")
        if c.get("by_passes") is not None and c["by_passes"] > c["count"]:
            text += f" (the passes fused {c['by_passes']}; the backend expanded them again)"
        parts.append(text)
    return ", ".join(parts)


def stage_summary(stage: Any) -> str:
    """What an export or optimize stage directory holds, in two lines."""
    info = stage.info
    g = info["geometry"]
    head = f"{stage.stage} {stage.path}: {info['architecture']} {g['num_layers']} layers"
    if stage.stage == "optimize":
        cfg = stage.history["optimize"]["config"]
        report = stage.history["optimize"]["fusion_report"]
        fired = [f"{n} {r['fired']}" + (f"/{r['expected']}" if r.get("expected") is not None else "")
                 for n, r in report.get("fusions", {}).items() if r["kind"] == "fusion" and (r["fired"] or r.get("expected"))]
        head += f", {cfg['target']} {cfg['precision']}, KV layout {stage.kv_layout}"
        return head + "\nfused: " + ", ".join(fired)
    return head + "\n" + validation_text(stage.validation)


def prefill_text(check: dict[str, Any]) -> str:
    """One line for an engine's int8 prefill graph check (``prefill_check`` in the manifest)."""
    line = (f"int8 prefill graph: held-out perplexity x{check['ratio']:.3f} of the decoder graph's alone (bound "
            f"x{check['bound']:g}), top-1 agreement {check['top1_agreement']:.0%}")
    alphas = check.get("down_projection_alphas")  # absent: an engine built before c2ecd7c
    if alphas:
        strengths = sorted({a for a in alphas if a is not None})
        how = "unsmoothed" if not strengths else f"smoothed {strengths[0]:g}" + (
            f"-{strengths[-1]:g}" if len(strengths) > 1 else "")
        line += f"; down projections in int8 ({how})"
    elif alphas is not None:  # kept on the decoder's kernel: the graph with them in int8 was past the bound
        past = check.get("ratio_with_int8_down_projections")
        line += "; down projections on the decoder's kernel" + (f" (in int8: x{past:.3f})" if past else "")
    return line
