"""KV layout ``scatter_buffer`` for the ``tensorrt`` target: the cache is a preallocated buffer updated in place.

The export grows each layer's cache by concatenation (a copy of the whole cache per layer and step) and masks
left padding with ``attention_mask``::

    past_key_values.i.key [B,KV,P,D] --+
                 k (new) [B,KV,S,D] --Concat(axis -2)--> present.i.key [B,KV,P+S,D] --> attention
    attention_mask [B,P+S] --Range/LessOrEqual/And/Where--> mask [B,1,S,P+S]   (sliding: one more And)

becomes (``C`` = the buffers' capacity, ``PassConfig.max_seq_len``: the engine's longest sequence)::

    position_ids [B,S] --Gather(0, axis 1)--> write_indices [B]
    past_key_values.i.key [B,KV,C,D] --+
                 k (new) [B,KV,S,D] --TensorScatter(axis -2, linear)--> present.i.key [B,KV,C,D] --> attention
            write_indices [B] ------+
    slots = Range(0, C) [C]
    position_ids [B,S] -Unsqueeze(-1)-LessOrEqual(slots, .)-> [B,S,C] -(sliding: And(pos - slot < window))-
        -Unsqueeze(1)-Where(., 0, lowest)-> mask [B,1,S,C]

Key slot ``j`` is visible to query ``(b, i)`` iff ``j <= position_ids[b, i]`` (and, on sliding layers,
``position_ids[b, i] - j < window``); the 0 / lowest values are the old mask's own constants. ``attention_mask``
leaves the graph inputs; no input is added. Binding ``present.i.*`` to ``past_key_values.i.*``'s buffer makes
the update in place (ONNX Runtime skips TensorScatter's copy then). TensorRT 10.15 imports TensorScatter as its
KVCacheUpdate layer, whose cache must be a network input with a *static* sequence dimension and whose output must be
a network output sharing the input's memory (NVIDIA's KVCacheUpdate operator reference): so ``C`` is written into
the graph as a number, and nothing may sit between ``past_key_values.i.*``, the TensorScatter and ``present.i.*``.

Prompts are right-padded: row ``b``'s token ``t`` lives in slot ``t``. In a batched prefill the pad tokens of a
short row write garbage into the slots after its length; no query sees them before they are overwritten::

    C = 8; row 0 has 5 prompt tokens, row 1 has 3 (padded to S = 5); position_ids = arange(5) for both

    prefill, write_indices [0, 0]       slot  0  1  2  3  4  5  6  7
                                       row 0  a  b  c  d  e  .  .  .
                                       row 1  x  y  z  #  #  .  .  .   # pad K/V (garbage), . zeros
       row 1's real queries sit at positions 0..2 and see slots j <= position: never a #

    decode, position_ids [[5], [3]], write_indices [5, 3]
                                       row 0  a  b  c  d  e  f  .  .
                                       row 1  x  y  z  w  #  .  .  .   w overwrote slot 3, in this same step,
                                                                        before the query at position 3 read it

The invariant the runtime keeps: each step's tokens of row ``b`` sit at consecutive positions starting at
``position_ids[b, 0]`` (pads after them), that start is the row's length so far, ``position_ids[b, 0] + S <= C``
for every row (``linear`` mode has no room past the end; ONNX Runtime refuses such a write), and the buffers start
zeroed (a masked slot is multiplied by an exact 0, which NaN garbage would survive). Every layer keeps its full
history; sliding layers see their window through the mask only, as in the export.

All or nothing: the graph is rewritten only if every ``past_key_values.*`` input feeds exactly one such Concat
into its ``present.*`` output, every old mask is found (and its layers say full or sliding), ``attention_mask``
has no other reader and the LM head takes its rows from ``logits_positions`` (not from the last column, a pad of
the short rows); the default opset is raised to 24 (TensorScatter's), see :mod:`trtinfer.passes.opset`.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from trtinfer.errors import ConfigError
from trtinfer.passes.layout import LAYOUT_KEY, last_token_slice
from trtinfer.passes.opset import upgrade_opset
from trtinfer.passes.registry import PassContext, register_pass

log = logging.getLogger(__name__)

SCATTER = "scatter_buffer"
SCATTER_OPSET = 24  # first opset with TensorScatter
FULL, SLIDING = "full_attention", "sliding_attention"
PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)$")
PRESENT = re.compile(r"present\.(\d+)\.(key|value)$")
LAYER = re.compile(r"layers\.(\d+)(?:\D|$)")
# ops a mask goes through on its way to the scores, and a repeated K/V on its way from present.i.value to P @ V
_VIEW_OPS = frozenset({"Unsqueeze", "Squeeze", "Slice", "Reshape", "Expand", "Transpose", "Identity", "Cast"})


@dataclass
class _Plan:
    """What :func:`plan_scatter` found: the cache Concats and each old mask with its kind (full or sliding)."""

    concats: list[ir.Node]
    masks: list[tuple[ir.Node, str]]
    attention_mask: ir.Value
    position_ids: ir.Value
    past: ir.Value  # a past buffer, for the capacity


def _const(v: ir.Value | None) -> np.ndarray | None:
    """The value of an initializer or Constant-node output, else None."""
    if v is None:
        return None
    if v.const_value is not None:
        return np.asarray(v.const_value.numpy())
    node = v.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return np.asarray(node.attributes["value"].as_tensor().numpy())
    return None


def _cache_concat(past: ir.Value) -> ir.Node | str:
    """The ``Concat(past, new, axis -2)`` writing ``present.N.x`` that is ``past``'s only reader, or why not."""
    m = PAST.match(past.name or "")
    assert m is not None
    readers = [u.node for u in past.uses()]
    if len(readers) != 1 or readers[0].op_type != "Concat" or len(readers[0].inputs) != 2:
        return f"{past.name} is read by {[n.op_type for n in readers]}, not by one Concat"
    node = readers[0]
    rank = past.shape.rank() if past.shape is not None else 4
    axis = node.attributes.get_int("axis", 0)
    if node.inputs[0] is not past or axis not in (-2, rank - 2):
        return f"{past.name}'s Concat is not Concat(past, new, axis=-2)"
    out = node.outputs[0]
    if out.name != f"present.{m.group(1)}.{m.group(2)}" or not out.is_graph_output():
        return f"{past.name}'s Concat does not write the graph output present.{m.group(1)}.{m.group(2)}"
    return node


def _reaches_back(starts: list[ir.Value], target: ir.Value, stops: frozenset[int] = frozenset()) -> bool:
    """Walking producers upstream from ``starts``, without passing values whose id is in ``stops``: is ``target``
    met?"""
    todo, seen = [v for v in starts if id(v) not in stops], set()
    while todo:
        v = todo.pop()
        if v is target:
            return True
        node = v.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(x for x in node.inputs if x is not None and id(x) not in stops)
    return False


def _depends_on(value: ir.Value, target: ir.Value) -> bool:
    """``target`` is ``value`` or one of its ancestors."""
    return _reaches_back([value], target)


def _is_padding_mask(node: ir.Node, attention_mask: ir.Value) -> bool:
    """``Where(cond(attention_mask), 0, lowest)``: the exporter's additive mask (lowest: the dtype's lowest or
    -inf)."""
    if node.op_type != "Where" or len(node.inputs) != 3 or node.inputs[0] is None:
        return False
    if not _depends_on(node.inputs[0], attention_mask):
        return False
    zero, blocked = _const(node.inputs[1]), _const(node.inputs[2])
    if zero is None or blocked is None or zero.size != 1 or blocked.size != 1:
        return False
    if not np.issubdtype(blocked.dtype, np.floating):
        return False
    low = blocked.reshape(())
    return float(zero.reshape(())) == 0.0 and (bool(np.isneginf(low)) or low == np.finfo(blocked.dtype).min)


def _present_layer(v: ir.Value | None) -> int | None:
    """N when ``v`` is ``present.N.*`` seen through views (the K/V heads repeated for TensorRT), else None."""
    while v is not None:
        m = PRESENT.match(v.name or "")
        if m:
            return int(m.group(1))
        node = v.producer()
        v = node.inputs[0] if node is not None and node.op_type in _VIEW_OPS else None
    return None


def layers_reading(mask: ir.Value) -> set[int]:
    """Layers whose attention reads ``mask``: from the names of the nodes between it and the Softmax
    (``.../layers.N/...``) and from the ``present.N.value`` each reached Softmax's ``P @ V`` multiplies."""
    layers: set[int] = set()
    todo, seen = [mask], set()
    while todo:
        for use in todo.pop().uses():
            node = use.node
            if id(node) in seen:
                continue
            seen.add(id(node))
            m = LAYER.search(node.name or "")
            if m:
                layers.add(int(m.group(1)))
            if node.op_type != "Softmax":
                todo.extend(node.outputs)
                continue
            for pv in node.outputs[0].uses():
                n = _present_layer(pv.node.inputs[1]) if pv.node.op_type == "MatMul" and pv.idx == 0 else None
                if n is not None:
                    layers.add(n)
    return layers


def _mask_kind(mask: ir.Value, geometry: dict[str, Any]) -> str | None:
    """``full_attention`` or ``sliding_attention`` for the layers reading ``mask``; None if they disagree or are
    unknown on a model that has both kinds."""
    types: list[str] = list(geometry.get("layer_types") or [])
    if not geometry.get("sliding_window") or not types:
        return FULL if SLIDING not in types else None
    if len(set(types)) == 1:
        return types[0]
    layers = layers_reading(mask)
    if not layers or max(layers) >= len(types):
        return None
    kinds = {types[i] for i in layers}
    return kinds.pop() if len(kinds) == 1 else None


def _reads_outside(graph: ir.Graph, value: ir.Value, stops: list[ir.Value]) -> bool:
    """Some graph output depends on ``value`` other than through the ``stops`` values."""
    return _reaches_back(list(graph.outputs), value, frozenset(id(v) for v in stops))


def plan_scatter(graph: ir.Graph, geometry: dict[str, Any]) -> _Plan | str:
    """Find what :func:`kv_scatter` rewrites, editing nothing; a string says why the graph does not qualify."""
    inputs = {v.name: v for v in graph.inputs}
    attention_mask, position_ids = inputs.get("attention_mask"), inputs.get("position_ids")
    if attention_mask is None or position_ids is None:
        return "the graph has no attention_mask and position_ids inputs (not the concat layout)"
    pasts = [v for v in graph.inputs if PAST.match(v.name or "")]
    if not pasts:
        return "the graph has no past_key_values.* inputs"
    if last_token_slice(graph) is not None:
        return ("the LM head reads hidden[:, -1:], a pad token of a short right-padded row: run logits_positions "
                "first")
    n_layers = geometry.get("num_layers")
    if n_layers and len(pasts) != 2 * int(n_layers):
        return f"{len(pasts)} past_key_values inputs for {n_layers} layers"
    concats = []
    for past in pasts:
        found = _cache_concat(past)
        if isinstance(found, str):
            return found
        concats.append(found)
    masks = [n for n in graph if _is_padding_mask(n, attention_mask)]
    if not masks:
        return "no additive mask Where(cond(attention_mask), 0, lowest) found"
    kinds = []
    for node in masks:
        kind = _mask_kind(node.outputs[0], geometry)
        if kind is None:
            return f"the layers reading mask {node.outputs[0].name} are not all full or all sliding attention"
        if kind == SLIDING and not geometry.get("sliding_window"):
            return "a sliding-window mask on a model without sliding_window in its geometry"
        kinds.append(kind)
    if _reads_outside(graph, attention_mask, [n.outputs[0] for n in masks]):
        return "attention_mask is read by more than the masks"
    return _Plan(concats, list(zip(masks, kinds)), attention_mask, position_ids, pasts[0])


def _new_masks(tape: ir.tape.Tape, plan: _Plan, window: int | None) -> dict[str, ir.Value]:
    """The position-based additive masks ``[B,1,S,C]``, one per kind the old masks had."""
    i64 = ir.DataType.INT64

    def const(value: Any, dtype: ir.DataType = i64) -> ir.Value:
        return tape.op("Constant", [], attributes={"value": ir.tensor(value, dtype=dtype)})

    capacity = tape.op("Gather", [tape.op("Shape", [plan.past]), const(2)], attributes={"axis": 0})
    slots = tape.op("Range", [const(0), capacity, const(1)])  # [C]
    positions = tape.op("Unsqueeze", [plan.position_ids, const([-1])])  # [B,S,1]
    visible = {FULL: tape.op("LessOrEqual", [slots, positions])}  # [B,S,C]
    if any(kind == SLIDING for _, kind in plan.masks):
        back = tape.op("Sub", [positions, slots])
        visible[SLIDING] = tape.op("And", [visible[FULL], tape.op("Less", [back, const(int(window or 0))])])
    made: dict[str, ir.Value] = {}
    for where, kind in plan.masks:
        if kind in made:
            continue
        keep = tape.op("Unsqueeze", [visible[kind], const([1])])  # [B,1,S,C]
        zero, blocked = (_const(where.inputs[i]) for i in (1, 2))  # the old mask's own 0 and lowest
        assert zero is not None and blocked is not None
        made[kind] = tape.op("Where", [keep, tape.op("Constant", [], attributes={"value": ir.tensor(zero.reshape(()))}),
                                       tape.op("Constant", [], attributes={"value": ir.tensor(blocked.reshape(()))})])
        made[kind].name = f"kv_scatter/{kind}_mask"
    return made


def _capacity_shapes(graph: ir.Graph, capacity: int) -> None:
    """KV inputs and outputs get ``capacity`` slots; so do the shapes that named the old total length."""
    for v in [*graph.inputs, *graph.outputs]:
        if (PAST.match(v.name or "") or PRESENT.match(v.name or "")) and v.shape is not None and len(v.shape) == 4:
            dims = list(v.shape)
            dims[2] = capacity
            v.shape = ir.Shape(dims)
    for node in graph:
        for out in node.outputs:
            if out.shape is not None and any(str(d) == "total_sequence" for d in out.shape):
                out.shape = ir.Shape([capacity if str(d) == "total_sequence" else d for d in out.shape])


def rewrite_scatter(model: ir.Model, plan: _Plan, capacity: int, window: int | None) -> None:
    """Apply ``plan``: TensorScatter per cache Concat into ``capacity``-slot buffers, position-based masks,
    ``attention_mask`` dropped."""
    graph = model.graph
    tape = ir.tape.Tape()
    index0 = tape.op("Constant", [], attributes={"value": ir.tensor(0, dtype=ir.DataType.INT64)})
    write_indices = tape.op("Gather", [plan.position_ids, index0], attributes={"axis": 1})  # [B]
    write_indices.name = "kv_scatter/write_indices"
    masks = _new_masks(tape, plan, window)
    first = next(iter(graph))
    graph.insert_before(first, tape.nodes)  # reads graph inputs and its own constants only
    for concat in plan.concats:
        past, new = concat.inputs
        assert past is not None and new is not None
        scatter = ir.node("TensorScatter", [past, new, write_indices], attributes={"axis": -2, "mode": "linear"},
                          name=f"{concat.name or past.name}/TensorScatter")
        out = concat.outputs[0]
        scatter.outputs[0].type, scatter.outputs[0].shape = out.type, out.shape
        ir.convenience.replace_nodes_and_values(graph, concat, [concat], [scatter], [out], [scatter.outputs[0]])
    for where, kind in plan.masks:
        where.outputs[0].replace_all_uses_with(masks[kind])
    ir.passes.common.RemoveUnusedNodesPass()(model)
    if not plan.attention_mask.uses():
        graph.inputs.remove(plan.attention_mask)
    _capacity_shapes(graph, capacity)


def _expected(ctx: PassContext) -> int | None:
    if ctx.config.target != "tensorrt":
        return 0
    n = ctx.geometry.get("num_layers")
    return int(n) if n else None


@register_pass("kv_scatter", kind="layout", expected=_expected)
def kv_scatter(model: ir.Model, ctx: PassContext) -> int:
    """Concat KV cache -> TensorScatter into max_seq_len-slot buffers, masks from position_ids (tensorrt; per layer)."""
    if ctx.config.target != "tensorrt":
        return 0
    plan = plan_scatter(model.graph, ctx.geometry)
    if isinstance(plan, str):
        log.info("kv_scatter: %s; the graph keeps the concat layout", plan)
        return 0
    try:
        upgrade_opset(model, SCATTER_OPSET)
    except ConfigError as e:
        log.warning("kv_scatter: %s; the graph keeps the concat layout", e)
        return 0
    window = ctx.geometry.get("sliding_window")
    rewrite_scatter(model, plan, ctx.config.max_seq_len, int(window) if window else None)
    model.metadata_props[LAYOUT_KEY] = SCATTER
    ctx.notes["kv_layout"] = SCATTER
    return len(plan.concats) // 2
