"""Pack MatMulNBits nodes that read the same input into one, and feed GroupQueryAttention packed QKV.

    x -MatMulNBits(Wq)-> q, x -MatMulNBits(Wk)-> k, x -MatMulNBits(Wv)-> v  ->  GroupQueryAttention(q, k, v, ...)
becomes
    x -MatMulNBits([Wq|Wk|Wv])-> qkv                                        ->  GroupQueryAttention(qkv, -, -, ...)
and gate/up projections become one MatMulNBits followed by a Split.

At batch 1 a decode step is dozens of small matrix-vector products; each MatMulNBits call quantizes its input to
int8 and dispatches to the thread pool on its own, so three calls on one input cost more than one call three
times as wide. Blocks run along K per output column, so stacking columns (N) of identically laid-out weights is
exact: same codes, same scales. Only symmetric nodes without zero points, bias or g_idx are packed.
"""
from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import onnx_ir as ir

from trtinfer.quantization.weights import MS_DOMAIN, add_initializer

log = logging.getLogger(__name__)

ATTRS = ("K", "bits", "block_size", "accuracy_level")


def concatenated(parts: list[ir.TensorProtocol], axis: int = 0) -> ir.LazyTensor:
    """``parts`` joined along ``axis``, computed when read (nothing is held in memory until then)."""
    dims = [int(d) for d in parts[0].shape.numpy()]
    dims[axis] = sum(int(p.shape.numpy()[axis]) for p in parts)
    return ir.LazyTensor(lambda: ir.Tensor(np.concatenate([p.numpy() for p in parts], axis=axis)),
                         dtype=parts[0].dtype, shape=ir.Shape(dims))


def _packable(node: ir.Node) -> bool:
    if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN or len(node.inputs) != 3:
        return False
    b, scales = node.inputs[1], node.inputs[2]
    return (b is not None and scales is not None and b.const_value is not None and scales.const_value is not None
            and len(b.uses()) == 1 and len(scales.uses()) == 1 and node.inputs[0] is not None)


def pack_shared_inputs(graph: ir.Graph) -> dict[str, int]:
    """Pack same-input MatMulNBits groups (see the module docstring); returns counts of what was done."""
    groups: dict[tuple[int, tuple[int, ...]], list[ir.Node]] = defaultdict(list)
    for node in graph:
        if _packable(node):
            key = tuple(node.attributes.get_int(a, -1) for a in ATTRS)
            groups[(id(node.inputs[0]), key)].append(node)
    packed = corrected = 0
    splits: list[ir.Node] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        ns = [m.attributes.get_int("N", 0) for m in members]
        first = members[0]
        # stacked when written (the parts may be computed then too): [N_i, K/block, blob] rows, [N_i * K/block] scales
        b = concatenated([m.inputs[1].const_value for m in members])  # type: ignore[union-attr,misc]
        s = concatenated([m.inputs[2].const_value for m in members])  # type: ignore[union-attr,misc]
        base = (first.name or "matmul").replace("/", "_").strip("_")
        attrs = {a: first.attributes.get_int(a, 0) for a in ATTRS}
        new = ir.node("MatMulNBits", [first.inputs[0], add_initializer(graph, f"{base}_packed_B", b),
                                      add_initializer(graph, f"{base}_packed_scales", s)],
                      domain=MS_DOMAIN, name=f"{first.name}_packed", attributes={**attrs, "N": int(sum(ns))})
        sizes = add_initializer(graph, f"{base}_packed_split", np.array(ns, dtype=np.int64))
        split = ir.node("Split", [new.outputs[0], sizes], attributes={"axis": -1}, num_outputs=len(members),
                        name=f"{first.name}_packed_split")
        graph.insert_before(first, [new, split])
        for m, out in zip(members, split.outputs):
            old = m.outputs[0]
            out.name, out.shape, out.type = old.name, old.shape, old.type
            old.replace_all_uses_with(out, replace_graph_outputs=True)
        for m in members:
            graph.remove(m, safe=True)
        # right after the group's B and scales: a save writes them in a row, so a weight computed when written
        # (an imported GGUF's blocks) is still in the block cache for its corrections, not computed twice
        merged = _merge_corrections(graph, split)
        corrected += merged is not None
        splits.append(split if merged is None else merged)
        packed += len(members)
    qkv = 0
    for split in splits:
        outs = list(split.outputs)
        users = [u.node for o in outs for u in o.uses()]
        if len(outs) != 3 or len(users) != 3 or any(u is not users[0] for u in users):
            continue
        gqa = users[0]
        if gqa.op_type != "GroupQueryAttention" or list(gqa.inputs[:3]) != outs:
            continue
        gqa.replace_input_with(0, split.inputs[0])
        gqa.replace_input_with(1, None)
        gqa.replace_input_with(2, None)
        graph.remove(split, safe=True)
        qkv += 1
    log.debug("packed %d MatMulNBits into %d; %d attentions take packed QKV", packed, len(splits), qkv)
    return {"matmuls_packed": packed, "packed_nodes": len(splits), "packed_qkv_attention": qkv,
            "corrections_packed": corrected}


def _merge_corrections(graph: ir.Graph, split: ir.Node) -> ir.Node | None:
    """``Split(y) -> Add(y_i, MatMul(xs, C_i))`` for every part, one ``xs`` -> ``Split(y + MatMul(xs, [C_1|..|C_n]))``.

    The block-sum corrections of imported GGUF blocks with mins (see :mod:`trtinfer.quantization.gguf`) follow
    their MatMulNBits; packed, the corrections of one input become one MatMul and one Add. Returns the new Split.
    """
    adds, cs, xs = [], [], None  # cs: each part's C [K/32, N_i], joined along N when written
    for out in split.outputs:
        uses = list(out.uses())
        if len(uses) != 1 or uses[0].node.op_type != "Add":
            return None
        add = uses[0].node
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        mm = other.producer() if other is not None else None
        if mm is None or mm.op_type != "MatMul" or len(other.uses()) != 1:  # type: ignore[union-attr]
            return None
        c = mm.inputs[1]
        if c is None or c.const_value is None or (xs is not None and mm.inputs[0] is not xs):
            return None
        xs = mm.inputs[0]
        adds.append(add)
        cs.append(c.const_value)
    assert xs is not None
    packed = split.inputs[0]
    assert packed is not None
    base = (split.name or "packed").replace("/", "_")
    corr = ir.node("MatMul", [xs, add_initializer(graph, f"{base}_corrections", concatenated(cs, axis=1))],
                   name=f"{split.name}_corrections")
    add = ir.node("Add", [packed, corr.outputs[0]], name=f"{split.name}_corrected")
    new = ir.node("Split", [add.outputs[0], split.inputs[1]], attributes={"axis": -1}, num_outputs=len(adds),
                  name=f"{split.name}_after_corrections")
    graph.insert_after(split, [corr, add, new])
    for old, out in zip(adds, new.outputs):
        o = old.outputs[0]
        out.name, out.shape, out.type = o.name, o.shape, o.type
        o.replace_all_uses_with(out, replace_graph_outputs=True)
    olds = [a.inputs[1] if a.inputs[0] in split.outputs else a.inputs[0] for a in adds]
    for a in adds:
        graph.remove(a, safe=True)
    for v in olds:
        graph.remove(v.producer(), safe=True)  # type: ignore[union-attr,arg-type]
    graph.remove(split, safe=True)
    return new
