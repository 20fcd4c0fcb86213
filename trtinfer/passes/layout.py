"""KV layout for GroupQueryAttention graphs: past and present share one preallocated buffer per layer.

After :mod:`trtinfer.passes.attention` fused every layer, the graph contract changes to::

    input_ids [B,S], seqlens_k [B] int32 (tokens in the row after this step - 1), total_sequence_length [] int32,
    (position_ids [B,S] only if something besides rotary still reads it, e.g. GPT-2's learned positions),
    past_key_values.i.key/value [B,KV,max_sequence,D]  ->  logits [B,1,V], present.i.key/value [B,KV,max_sequence,D]

The runtime binds ``past`` and ``present`` to the same buffer, so decode writes one new position in place instead
of concatenating (copying) the whole cache every step. Prompts are right-padded, so each row's logits must come from
its own last real token: :func:`logits_positions` (which runs first in the pipelines) lets the runtime say which
position of each row reaches the LM head. Only when that pass is disabled does this one pick the rows' last tokens
itself: ``index = min(seqlens_k, S - 1)`` (first prompt: the row's last token; decode: position 0).

``logits_positions`` (every KV layout, every target) replaces the ``hidden[:, -1:, :]`` Slice that
``logits_to_keep=1`` traced before the LM head by a gather at a new graph input::

    hidden [B,S,D] -Slice(-1:, axis 1)-> [B,1,D] -LM head-> logits [B,1,V]

becomes::

    logits_positions [B,K] int64 -Unsqueeze(-1)-> [B,K,1] -+
    hidden [B,S,D] ------------------------------------------GatherND(batch_dims=1)-> [B,K,D] -LM head-> logits [B,K,V]

Generation feeds one position per row (its last prompt token in prefill, 0 in decode): the LM head costs what it
did. Scoring feeds ``arange(S)`` and gets every position's logits from the same engine.
"""
from __future__ import annotations

import logging

import onnx_ir as ir

from trtinfer.passes.attention import SEQLENS, TOTAL_SEQ, const_array
from trtinfer.passes.registry import PassContext, register_pass

log = logging.getLogger(__name__)

LAYOUT_KEY = "trtinfer.kv_layout"
SHARED = "shared_buffer"
CONCAT = "concat"
INT64_MAX = 2**63 - 1
LOGITS_POSITIONS = "logits_positions"


def _const_list(v: ir.Value | None) -> list[int] | None:
    arr = const_array(v)
    return None if arr is None else [int(x) for x in arr.reshape(-1)]


def last_token_slice(graph: ir.Graph) -> ir.Node | None:
    """The ``hidden[:, -1:, :]`` Slice that ``logits_to_keep=1`` traced (exactly one), or None."""
    found = []
    for node in graph:
        if node.op_type != "Slice" or len(node.inputs) < 4:
            continue
        starts, ends, axes = (_const_list(node.inputs[i]) for i in (1, 2, 3))
        if starts == [-1] and ends is not None and ends[0] >= 2**31 - 1 and axes == [1]:
            found.append(node)
    return found[0] if len(found) == 1 else None


def _gather_last_tokens(graph: ir.Graph, sl: ir.Node, seqlens: ir.Value) -> None:
    """Replace ``hidden[:, -1:]`` by ``hidden[b, min(seqlens_k[b], S-1)]`` (right padding)."""
    hidden = sl.inputs[0]
    assert hidden is not None
    tape = ir.tape.Tape()
    one = tape.op("Constant", [], attributes={"value": ir.tensor([1], dtype=ir.DataType.INT64)})
    shape = tape.op("Shape", [hidden], attributes={"start": 1, "end": 2})
    last = tape.op("Sub", [shape, one])
    idx = tape.op("Cast", [seqlens], attributes={"to": ir.DataType.INT64})
    idx = tape.op("Min", [idx, last])
    idx = tape.op("Unsqueeze", [idx, one])  # [B,1]
    picked = tape.op("GatherND", [hidden, idx], attributes={"batch_dims": 1})  # [B,D]
    out = tape.op("Unsqueeze", [picked, one])  # [B,1,D]
    graph.insert_before(sl, tape.nodes)
    sl.outputs[0].replace_all_uses_with(out)
    graph.remove(sl, safe=True)


def share_kv_buffers(model: ir.Model, ctx: PassContext) -> bool:
    """Switch the graph contract to the shared-buffer layout; False (untouched) unless every layer is fused."""
    graph = model.graph
    n_layers = int(ctx.geometry.get("num_layers", 0))
    gqa = [n for n in graph if n.op_type == "GroupQueryAttention"]
    if not n_layers or len(gqa) != n_layers:
        return False
    inputs = {v.name: v for v in graph.inputs}
    seqlens = inputs[SEQLENS]
    sl = last_token_slice(graph)
    if sl is not None:  # logits_positions was disabled: the graph picks each row's last token itself
        _gather_last_tokens(graph, sl, seqlens)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    # inputs nothing reads any more (attention_mask; position_ids when rotary was the only reader) leave the contract
    used = {id(v) for n in graph for v in n.inputs if v is not None}
    for v in list(graph.inputs):
        if id(v) not in used and v.name in ("attention_mask", "position_ids"):
            graph.inputs.remove(v)
    for v in list(graph.inputs) + list(graph.outputs):
        if v.name and (v.name.startswith("past_key_values.") or v.name.startswith("present.")) and v.shape:
            dims = list(v.shape)
            dims[2] = ir.SymbolicDim("max_sequence")
            v.shape = ir.Shape(dims)
    # the contract order: input_ids, seqlens_k, total_sequence_length, [position_ids], [logits_positions], past...
    order = {"input_ids": 0, SEQLENS: 1, TOTAL_SEQ: 2, "position_ids": 3, LOGITS_POSITIONS: 4}
    ordered = sorted(graph.inputs, key=lambda v: (order.get(v.name or "", 10), list(graph.inputs).index(v)))
    graph.inputs.clear()
    graph.inputs.extend(ordered)
    return True


@register_pass("kv_share_buffer", kind="layout")
def kv_share_buffer(model: ir.Model, ctx: PassContext) -> int:
    """Past/present KV share one max-length buffer; seqlens replace the growing mask (1 if switched, else 0)."""
    switched = share_kv_buffers(model, ctx)
    layout = SHARED if switched else CONCAT
    model.metadata_props[LAYOUT_KEY] = layout
    ctx.notes["kv_layout"] = layout
    return int(switched)


def _forget_shapes_after(value: ir.Value) -> None:
    """Drop the stored shapes downstream of ``value`` (their position axis was 1, is now K); outputs get K named."""
    outputs = {id(v) for v in value.graph.outputs} if value.graph is not None else set()
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        for node in v.consumers():
            for out in node.outputs:
                if id(out) in seen:
                    continue
                seen.add(id(out))
                if id(out) in outputs:
                    if out.shape is not None and len(out.shape) == 3:
                        out.shape = ir.Shape([out.shape[0], ir.SymbolicDim("positions"), out.shape[2]])
                else:
                    out.shape = None
                todo.append(out)


def gather_logits_positions(graph: ir.Graph, sl: ir.Node) -> ir.Value:
    """Replace the Slice ``sl`` (``hidden[:, -1:]``) by ``hidden`` at a new graph input ``logits_positions [B,K]``."""
    hidden = sl.inputs[0]
    assert hidden is not None
    ids = next((v for v in graph.inputs if v.name == "input_ids"), None)
    batch = ids.shape[0] if ids is not None and ids.shape is not None else ir.SymbolicDim("batch")
    positions = ir.Value(name=LOGITS_POSITIONS, type=ir.TensorType(ir.DataType.INT64),
                         shape=ir.Shape([batch, ir.SymbolicDim("positions")]))
    tape = ir.tape.Tape()
    last = tape.op("Constant", [], attributes={"value": ir.tensor([-1], dtype=ir.DataType.INT64)})
    idx = tape.op("Unsqueeze", [positions, last])  # [B,K,1]
    picked = tape.op("GatherND", [hidden, idx], attributes={"batch_dims": 1})  # [B,K,D]
    graph.insert_before(sl, tape.nodes)
    sl.outputs[0].replace_all_uses_with(picked)
    graph.remove(sl, safe=True)
    _forget_shapes_after(picked)
    # before the KV inputs, as the contract lists them: input_ids, ..., logits_positions, past_key_values...
    at = next((i for i, v in enumerate(graph.inputs) if (v.name or "").startswith("past_key_values")),
              len(graph.inputs))
    graph.inputs.insert(at, positions)
    return positions


@register_pass(LOGITS_POSITIONS, kind="layout")
def logits_positions(model: ir.Model, ctx: PassContext) -> int:
    """``hidden[:, -1:]`` before the LM head -> ``hidden`` at the input ``logits_positions [B,K]`` (1 if replaced)."""
    if any(v.name == LOGITS_POSITIONS for v in model.graph.inputs):
        return 0
    sl = last_token_slice(model.graph)
    if sl is None:  # exported with logits="all" (every position already), or not a decoder graph
        return 0
    gather_logits_positions(model.graph, sl)
    return 1
