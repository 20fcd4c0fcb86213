"""Cleanup passes: constant folding, dead nodes, identity/cast elimination, shape-subgraph simplification.

These run first (fusion patterns then see one canonical form) and last (to drop what fusions left dead).
"""
from __future__ import annotations

from typing import Any

import onnx_ir as ir

from trtinfer.passes.registry import PassContext, register_pass

# onnxscript's default rewrite rules that matter for traced transformer graphs; its full default set (conv, pad,
# batch-norm, clip, scatter rules...) costs ~100 s on a 6k-node graph for nothing we use
_BASIC_RULES = {"CastCast", "CastIdentity", "ExpandIdentity", "ReshapeReshape", "TransposeIdentity",
                "TransposeTranspose", "UnsqueezeUnsqueeze", "MaterializeReshapeShape"}


def _rules() -> list[Any]:
    from onnxscript.rewriter import _DEFAULT_REWRITE_RULES

    # unnamed rules are the no-op eliminations (x+0, x*1, Identity, Dropout in inference...)
    return [r for r in _DEFAULT_REWRITE_RULES if r.name is None or r.name in _BASIC_RULES]


def _fold(model: ir.Model, iterations: int = 2) -> None:
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding

    common = ir.passes.common
    common.ShapeInferencePass()(model)  # dtypes + static shapes, so no-op casts and shape chains are provable
    rules = rewriter.RewriteRuleSet(_rules())
    for _ in range(iterations):
        changed = _constant_folding.FoldConstantsPass(shape_inference=False, input_size_limit=8192,
                                                      output_size_limit=262144)(model).modified
        changed |= rules.apply_to_model(model) > 0
        changed |= common.RemoveUnusedNodesPass()(model).modified
        if not changed:
            break
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    common.DeduplicateInitializersPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)


def remove_redundant_casts(model: ir.Model) -> int:
    """``Cast(x, to=T)`` where ``x`` is already ``T`` -> ``x``; returns how many were removed."""
    removed = 0
    for node in list(model.graph):
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
            continue
        src, out = node.inputs[0], node.outputs[0]
        to = node.attributes.get_int("to")
        if src is None or src.dtype is None or to is None or src.dtype.value != to:
            continue
        if out.is_graph_output():
            continue
        out.replace_all_uses_with(src)
        model.graph.remove(node, safe=True)
        removed += 1
    return removed


@register_pass("cleanup", kind="cleanup")
def cleanup(model: ir.Model, ctx: PassContext) -> int:
    """Fold constants and shape subgraphs, drop identities, no-op casts and dead nodes; returns nodes removed."""
    before = sum(1 for _ in model.graph)
    _fold(model)
    remove_redundant_casts(model)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return before - sum(1 for _ in model.graph)


@register_pass("dead_code", kind="cleanup")
def dead_code(model: ir.Model, ctx: PassContext) -> int:
    """Final sweep after fusions: fold what they left constant, drop dead nodes and initializers."""
    return cleanup(model, ctx)
