"""Cleanup passes: constant folding, dead nodes, identity/cast elimination, shape-subgraph simplification.

These run first (fusion patterns then see one canonical form) and last (to drop what fusions left dead).
"""
from __future__ import annotations

from typing import Any

import numpy as np
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


def _forget_intermediate_shapes(model: ir.Model) -> None:
    io = {id(v) for v in (*model.graph.inputs, *model.graph.outputs)}
    for node in model.graph:
        for v in node.outputs:
            if id(v) not in io:
                v.shape = None


def _fold(model: ir.Model, iterations: int = 4) -> None:
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding

    common = ir.passes.common
    rules = rewriter.RewriteRuleSet(_rules())
    for _ in range(iterations):
        # dtypes + static shapes (again after rewrites: new values have none), so no-op casts and shape chains
        # are provable
        _forget_intermediate_shapes(model)  # ONNX inference keeps a stale symbolic dim over a fresh one
        common.ShapeInferencePass()(model)
        changed = _constant_folding.FoldConstantsPass(shape_inference=False, input_size_limit=8192,
                                                      output_size_limit=262144)(model).modified
        changed |= rules.apply_to_model(model) > 0
        changed |= simplify_static_shapes(model) > 0
        changed |= common.RemoveUnusedNodesPass()(model).modified
        if not changed:
            break
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    common.DeduplicateInitializersPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)


def _static_dims(v: ir.Value | None) -> list[int | None] | None:
    if v is None or v.shape is None:
        return None
    return [d if isinstance(d, int) else None for d in v.shape]


def _ints(v: ir.Value | None) -> list[int] | None:
    if v is None or v.const_value is None:
        return None
    return [int(x) for x in v.const_value.numpy().reshape(-1)]


def _replace_with_constant(model: ir.Model, node: ir.Node, array: np.ndarray) -> None:
    out = node.outputs[0]
    name = f"{out.name}_static"
    const = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(array.shape),
                     const_value=ir.Tensor(array, name=name))
    model.graph.register_initializer(const)
    out.replace_all_uses_with(const, replace_graph_outputs=False)


def simplify_static_shapes(model: ir.Model) -> int:
    """Shape arithmetic the constant folder leaves when only some dims are static; returns rewrites.

    - ``Gather(Shape(x), i)`` where dim ``i`` of ``x`` is static -> that constant (Phi-3's ``rotary_dim =
      cos.shape[-1]``: without it the rotary slices stay dynamic and no rotary pattern matches);
    - ``Slice(x, 0, n, axis)`` covering all of a static axis -> ``x``;
    - ``Concat`` operands that are statically empty along the axis are dropped (``cat([x_rot, x[..., d:]])``).
    """
    done = 0
    for node in list(model.graph):
        if node.domain not in ("", "ai.onnx") or node.outputs[0].is_graph_output():
            continue
        op = node.op_type
        if op == "Gather" and node.inputs[0] is not None and (shape_node := node.inputs[0].producer()) is not None \
                and shape_node.op_type == "Shape":
            dims = _static_dims(shape_node.inputs[0])
            idx = _ints(node.inputs[1])
            if dims is None or idx is None or node.attributes.get_int("axis", 0) != 0:
                continue
            start = shape_node.attributes.get_int("start", 0) or 0
            end = shape_node.attributes.get_int("end", len(dims))
            window = dims[start:end if end is not None else len(dims)]
            picked = [window[i] if -len(window) <= i < len(window) else None for i in idx]
            if any(d is None for d in picked):
                continue
            rank0 = node.inputs[1] is not None and node.inputs[1].shape is not None and len(node.inputs[1].shape) == 0
            _replace_with_constant(model, node, np.array(picked[0] if rank0 else picked, dtype=np.int64))
            done += 1
        elif op == "Slice" and len(node.inputs) >= 4:
            dims = _static_dims(node.inputs[0])
            starts, ends, axes = _ints(node.inputs[1]), _ints(node.inputs[2]), _ints(node.inputs[3])
            steps = _ints(node.inputs[4]) if len(node.inputs) > 4 else None
            if dims is None or starts is None or ends is None or axes is None or (steps and set(steps) != {1}):
                continue
            src = node.inputs[0]
            if src is not None and all(st == 0 and dims[a] is not None and en >= dims[a]  # type: ignore[operator]
                                       for st, en, a in zip(starts, ends, axes)):
                node.outputs[0].replace_all_uses_with(src, replace_graph_outputs=False)
                done += 1
        elif op == "Concat":
            axis = node.attributes.get_int("axis", 0) or 0
            keep = []
            for v in node.inputs:
                dims = _static_dims(v)
                keep.append(not (dims is not None and -len(dims) <= axis < len(dims) and dims[axis] == 0))
            if all(keep) or not any(keep):
                continue
            kept = [v for v, k in zip(node.inputs, keep) if k]
            if len(kept) == 1 and kept[0] is not None:
                node.outputs[0].replace_all_uses_with(kept[0], replace_graph_outputs=False)
            else:
                new = ir.Node("", "Concat", kept, [ir.AttrInt64("axis", axis)], name=f"{node.name}_nonempty")
                model.graph.insert_before(node, new)
                node.outputs[0].replace_all_uses_with(new.outputs[0], replace_graph_outputs=False)
                new.outputs[0].shape = node.outputs[0].shape
                if node.outputs[0].dtype is not None:
                    new.outputs[0].dtype = node.outputs[0].dtype
            done += 1
    return done


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
