"""Cleanup passes: constant folding, dead nodes, identity/cast elimination, shape-subgraph simplification.

These run first (fusion patterns then see one canonical form) and last (to drop what fusions left dead).
"""
from __future__ import annotations

import onnx_ir as ir

from trtinfer.passes.registry import PassContext, register_pass


def _fold(model: ir.Model) -> None:
    import onnxscript.optimizer

    # constant folding + shape propagation (turns Shape->Gather->Concat chains with known dims into constants),
    # identity/no-op removal, unused nodes and initializers; iterated until nothing changes
    onnxscript.optimizer.optimize(model, num_iterations=3, onnx_shape_inference=True)


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
