"""The token embedding and the LM head: finding them, telling whether they are tied, storing a tied pair once.

A model with tied embeddings reads one matrix twice: the embedding ``Gather(E [V, H], ids)`` and the LM head
``MatMul(x, E^T [H, V])``. The export keeps both as they are read (the head's weight is ``E`` transposed), so an
engine that writes its weights out would store the largest matrix of a small model twice (Gemma-3-270M: 671 MB of its
1.07 GB of fp32 parameters). :func:`share_tied_embedding` keeps one of the two, in the form the target runs best:

* ONNX Runtime on the CPU, fp32 (``head_reads_table``): the head reads the embedding's table,
  ``FusedMatMul(x, E, transB=1)`` (com.microsoft), and the embedding keeps its row gather. MLAS prepacks the head's
  weight into its own layout either way; the builder then gives each reader of the table its own name for the same
  bytes on disk (:func:`trtinfer.builder.weight_views.one_name_per_reader`), so ONNX Runtime drops its mapping of
  the head's copy once packed and the embedding's mapping holds only the rows it read: resident memory is the
  untied engine's, the file holds the table once.
* elsewhere (CUDA, TensorRT, fp16/bf16): the embedding reads the head's weight,
  ``ids --Gather(E^T [H,V], axis=1)--> [H, .., ] --Transpose--> emb``, with standard ops only; the head keeps its
  plain ``MatMul`` and the embedding reads ``H`` strided elements per token (12 ms per 1,024 prompt tokens at
  SmolLM2's shape on the CPU). On the CPU this form would keep the head's whole table mapped beside its packed copy
  (SmolLM2 bs8: 830 vs 738 MiB peak), hence the first form there.

Run on the graph an engine is compiled from, never on a stage a quantizer reads: quantizers share a tied pair their
own way (one packed copy behind ``MatMulNBits`` and ``GatherBlockQuantized``), with the tie found by
:func:`tied_embedding`.
"""
from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from trtinfer.passes.config import CPU_TARGET
from trtinfer.passes.registry import PassContext, register_pass

log = logging.getLogger(__name__)

TIED_EMBEDDING = "tied_embedding"  # the pass's name (``--disable-pass tied_embedding``)
WEIGHT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def const_2d(v: ir.Value | None, dtypes: frozenset[ir.DataType] = frozenset({ir.DataType.FLOAT})) -> bool:
    """True when ``v`` is a constant 2-D weight (an initializer, not computed) of one of ``dtypes``."""
    return (v is not None and v.const_value is not None and v.producer() is None and v.shape is not None
            and len(v.shape) == 2 and v.const_value.dtype in dtypes)


def lm_head_node(graph: ir.Graph, vocab_size: int,
                 dtypes: frozenset[ir.DataType] = frozenset({ir.DataType.FLOAT})) -> ir.Node | None:
    """The MatMul whose output columns are the vocabulary and whose result reaches the ``logits`` output."""
    logits = next((v for v in graph.outputs if v.name == "logits"), None)
    seen: set[int] = set()
    stack = [logits.producer()] if logits is not None and logits.producer() is not None else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "MatMul" and const_2d(node.inputs[1], dtypes) and node.inputs[1].shape[1] == vocab_size:  # type: ignore[union-attr,index]
            return node
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    return None


def embedding_gather(graph: ir.Graph, vocab_size: int,
                     dtypes: frozenset[ir.DataType] = frozenset({ir.DataType.FLOAT})) -> ir.Node | None:
    """The Gather reading a constant ``[V, K]`` table along its rows (the token embedding)."""
    for node in graph:
        if node.op_type == "Gather" and node.domain == "" and const_2d(node.inputs[0], dtypes) \
                and node.attributes.get_int("axis", 0) == 0:
            table = node.inputs[0]
            if table.shape[0] == vocab_size:  # type: ignore[union-attr,index]
                return node
    return None


def tied_embedding(gather: ir.Node | None, head_weight: ir.Value | None) -> bool:
    """True when the embedding table equals the LM head's weight transposed (tied embeddings): by checkpoint tensor
    name when both are read from the checkpoint, else by value."""
    if gather is None or head_weight is None:
        return False
    table = gather.inputs[0]
    assert table is not None and table.const_value is not None and head_weight.const_value is not None
    from trtinfer.stage_weights import CheckpointTensor

    t, h = table.const_value, head_weight.const_value
    if isinstance(t, CheckpointTensor) and isinstance(h, CheckpointTensor):
        return t.tensor == h.tensor and h.transpose and not t.transpose
    if t.dtype != h.dtype or tuple(t.shape.numpy()) != tuple(reversed(h.shape.numpy())):
        return False
    return bool(np.array_equal(np.asarray(t.numpy()), np.asarray(h.numpy()).T))


def share_tied_embedding(model: ir.Model, vocab_size: int, *, head_reads_table: bool = False) -> bool:
    """Store a tied embedding once (see the module docstring); True when it did. ``head_reads_table``: the head
    reads the embedding's fp32 table through ``FusedMatMul(transB=1)`` (ONNX Runtime's CPU), else the embedding
    reads the head's weight along axis 1."""
    graph = model.graph
    head = lm_head_node(graph, vocab_size, WEIGHT_TYPES)
    gather = embedding_gather(graph, vocab_size, WEIGHT_TYPES)
    if head is None or gather is None or not tied_embedding(gather, head.inputs[1]):
        return False
    weight = head.inputs[1]
    assert weight is not None and weight.const_value is not None  # const_2d checked it
    if head_reads_table and weight.const_value.dtype == ir.DataType.FLOAT:
        _head_reads_table(graph, head, gather)
    elif not _embedding_reads_head(graph, head, gather):
        return False
    log.debug("tied embedding stored once")
    return True


def _drop_if_unused(graph: ir.Graph, value: ir.Value | None) -> None:
    if value is not None and value.is_initializer() and not value.uses():
        graph.initializers.pop(value.name)  # type: ignore[arg-type]


def _head_reads_table(graph: ir.Graph, head: ir.Node, gather: ir.Node) -> None:
    """``MatMul(x, E^T)`` -> ``FusedMatMul(x, E, transB=1)`` on the embedding's table."""
    x, weight, table = head.inputs[0], head.inputs[1], gather.inputs[0]
    name = head.name or "lm_head"
    fused = ir.node("FusedMatMul", [x, table], attributes={"transB": 1, "alpha": 1.0}, domain="com.microsoft",
                    name=f"{name}_reads_embedding")
    out = head.outputs[0]
    fused.outputs[0].name, fused.outputs[0].shape, fused.outputs[0].type = out.name, out.shape, out.type
    graph.insert_before(head, [fused])
    out.replace_all_uses_with(fused.outputs[0], replace_graph_outputs=True)
    graph.remove(head, safe=True)
    _drop_if_unused(graph, weight)
    graph.opset_imports.setdefault("com.microsoft", 1)


def _embedding_reads_head(graph: ir.Graph, head: ir.Node, gather: ir.Node) -> bool:
    """``Gather(E, ids)`` -> ``Transpose(Gather(E^T, ids, axis=1))`` on the head's weight."""
    weight, ids, out = head.inputs[1], gather.inputs[1], gather.outputs[0]
    assert weight is not None and weight.const_value is not None and ids is not None
    if ids.shape is not None:
        rank = len(ids.shape)
    elif out.shape is not None:
        rank = len(out.shape) - 1
    else:  # the Transpose needs the rank; a graph without shapes keeps both tables
        log.debug("tied embedding left as is: the rank of %s is unknown", ids.name)
        return False
    name = gather.name or "embedding"
    pick = ir.node("Gather", [weight, ids], attributes={"axis": 1}, name=f"{name}_from_lm_head")
    move = ir.node("Transpose", [pick.outputs[0]], attributes={"perm": [*range(1, rank + 1), 0]},
                   name=f"{name}_from_lm_head_transpose")
    graph.insert_before(gather, [pick, move])
    dtype = ir.TensorType(weight.const_value.dtype)
    pick.outputs[0].name, pick.outputs[0].type = f"{out.name}_transposed", dtype
    move.outputs[0].name, move.outputs[0].shape = out.name, out.shape
    move.outputs[0].type = out.type or dtype
    table = gather.inputs[0]
    out.replace_all_uses_with(move.outputs[0], replace_graph_outputs=True)
    graph.remove(gather, safe=True)
    _drop_if_unused(graph, table)
    return True


@register_pass(TIED_EMBEDDING, kind="layout")
def tied_embedding_pass(model: ir.Model, ctx: PassContext) -> int:
    """A tied embedding stored once (on ONNX Runtime's CPU the head reads the table, elsewhere the embedding reads
    the head's weight); the builder runs it on the engine graph."""
    vocab = ctx.geometry.get("vocab_size")
    cpu = ctx.config.target == CPU_TARGET
    return int(vocab is not None and share_tied_embedding(model, int(vocab), head_reads_table=cpu))
