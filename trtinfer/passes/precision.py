"""Mixed precision: convert a float32 graph to fp16 or bf16, keeping the numerically sensitive parts in float32.

Runs after the fusions (so a fused norm is one op to keep, not seven). Every node gets one compute type:

- **kept in fp32** (``PassConfig.keep_fp32`` groups): ``norms`` (the norm ops, fused or not: their sum of squares
  overflows fp16), ``softmax``, ``residual`` (Adds feeding a norm: the residual stream accumulates in fp32; fused
  Skip*Normalization ops are norms), ``logits`` (ops between the LM head and the ``logits`` output, and the output
  itself), ``lm_head`` (the LM head MatMul; off by default: it is the largest GEMM and tied to the embedding);
- **low precision**: MatMul/Gemm/attention ops and embedding Gathers, always (unless kept);
- **data movement** (Reshape, Concat, ...): low if any of its float inputs is low (casting later would be the same
  rounding), else fp32;
- **other compute**: fp32 if any float input is fp32 (masks and rotary angles derived from integer inputs stay
  fp32: ``position * inv_freq`` at position 4000 has no fractional bits left in fp16), else low.

A ``Cast`` is inserted wherever a value meets a node of the other type (one per value and type); float
initializers are converted once, or duplicated when both kinds of node read them. Constants are clipped to the
finite range of the low type (a mask's ``-3.4e38`` would become ``-inf``, and ``0 * -inf`` is NaN). Graph inputs and
outputs take the low type unless ``keep_io_types``; ``logits`` stays fp32 while ``logits`` is kept.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TypeGuard

import ml_dtypes
import numpy as np
import onnx_ir as ir

from trtinfer.passes.norms import FLOAT_TYPES as FLOATS
from trtinfer.passes.registry import PassContext, register_pass

log = logging.getLogger(__name__)

F32 = ir.DataType.FLOAT
LOW_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
NUMPY_TYPES = {ir.DataType.FLOAT16: np.float16, ir.DataType.BFLOAT16: ml_dtypes.bfloat16}
KEEP_GROUPS = ("norms", "softmax", "residual", "logits", "lm_head")
DEFAULT_KEEP = ("norms", "softmax", "residual", "logits")

NORM_OPS = frozenset({"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                      "SkipSimplifiedLayerNormalization", "RMSNormalization", "ReduceMean", "Pow"})
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax"})
LOW_ANCHORS = frozenset({"MatMul", "Gemm", "FusedMatMul", "GroupQueryAttention", "MultiHeadAttention", "Attention",
                         "Conv"})
MOVE_OPS = frozenset({"Reshape", "Transpose", "Concat", "Slice", "Split", "Squeeze", "Unsqueeze", "Expand",
                      "Identity", "Gather", "GatherND", "GatherElements", "Tile", "Flatten", "Pad", "TensorScatter"})
# inputs whose element type does not matter to the op: never cast them
TYPE_AGNOSTIC = frozenset({"Shape", "Size", "Cast", "CastLike"})
# outputs with their own float-only type parameter (mean / inverse std dev): they stay fp32 whatever the node is
STAT_OUTPUTS = {"LayerNormalization": {1, 2}, "SimplifiedLayerNormalization": {1}, "SkipLayerNormalization": {1, 2},
                "SkipSimplifiedLayerNormalization": {1, 2}}
# the ops a logits path may run through between the LM head and the output
LOGITS_PATH_OPS = frozenset({"GatherND", "Gather", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Mul",
                             "Div", "Tanh", "Identity", "Cast"})


def low_dtype(precision: str) -> ir.DataType:
    """The ONNX element type of ``fp16``/``bf16``."""
    return LOW_TYPES[precision]


def to_low(array: np.ndarray, dtype: ir.DataType) -> np.ndarray:
    """``array`` in the low type, clipped to its finite range (no inf from an out-of-range fp32 constant)."""
    np_type = NUMPY_TYPES[dtype]
    info = ml_dtypes.finfo(np_type)
    a = np.asarray(array, dtype=np.float32)
    finite = np.isfinite(a)
    a = np.where(finite, np.clip(a, float(info.min), float(info.max)), a)
    return a.astype(np_type)


def _std(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _is_float(v: ir.Value | None) -> TypeGuard[ir.Value]:
    return v is not None and v.dtype in FLOATS


def _infer_missing_dtypes(model: ir.Model) -> None:
    """Give every untyped output a dtype (fusion outputs have none): onnx inference, then inherit from inputs."""
    ir.passes.common.ShapeInferencePass()(model)
    for node in model.graph:
        for i, out in enumerate(node.outputs):
            if out.dtype is not None:
                continue
            if node.op_type in ("Shape", "Size"):
                out.dtype = ir.DataType.INT64
            elif node.op_type == "Cast":
                to = node.attributes.get_int("to")
                if to is not None:
                    out.dtype = ir.DataType(to)
            elif i in STAT_OUTPUTS.get(node.op_type, ()):
                out.dtype = F32
            else:
                src = next((v for v in node.inputs if _is_float(v)), None)
                if src is not None and src.dtype is not None:
                    out.dtype = src.dtype


def _is_constant(v: ir.Value) -> bool:
    return v.is_initializer() or v.const_value is not None and v.producer() is None


def _logits_path(model: ir.Model) -> tuple[set[ir.Node], ir.Node | None]:
    """Nodes from the LM head's output to ``logits`` (exclusive of the head) and the head MatMul itself."""
    out = next((v for v in model.graph.outputs if v.name == "logits"), None)
    path: set[ir.Node] = set()
    node = out.producer() if out is not None else None
    while node is not None:
        if node.op_type in ("MatMul", "Gemm"):
            return path, node
        if node.op_type not in LOGITS_PATH_OPS:
            return path, None
        path.add(node)
        node = next((v.producer() for v in node.inputs if _is_float(v) and not _is_constant(v)), None)
    return path, None


def _residual_adds(model: ir.Model) -> set[ir.Node]:
    """Adds whose output feeds a norm: the residual stream."""
    return {n for n in model.graph if n.op_type == "Add" and _std(n)
            and any(c.op_type in NORM_OPS and c.graph is model.graph for c in n.outputs[0].consumers())}


def _choose(model: ir.Model, low: ir.DataType, keep: Iterable[str]) -> dict[ir.Node, ir.DataType]:
    """Compute type of every node that reads or writes floats, in topological order."""
    keep = set(keep)
    fixed: dict[ir.Node, ir.DataType] = {}
    logits_nodes, head = _logits_path(model)
    if "logits" in keep:
        fixed.update({n: F32 for n in logits_nodes})
    if head is not None:
        fixed[head] = F32 if "lm_head" in keep else low
    if "residual" in keep:
        fixed.update({n: F32 for n in _residual_adds(model)})
    # kept-fp32 graph inputs are an interface type, not a compute type: they propagate as low values
    value_type: dict[ir.Value, ir.DataType] = {v: low for v in model.graph.inputs if _is_float(v)}
    chosen: dict[ir.Node, ir.DataType] = {}
    for node in model.graph:
        floats_in = [v for v in node.inputs if _is_float(v)]
        floats_out = [v for v in node.outputs if _is_float(v)]
        if not floats_in and not floats_out:
            continue
        dynamic = [value_type.get(v, v.dtype) for v in floats_in if not _is_constant(v)]
        op = node.op_type
        if node in fixed:
            t = fixed[node]
        elif ("norms" in keep and op in NORM_OPS) or ("softmax" in keep and op in SOFTMAX_OPS):
            t = F32
        elif op in LOW_ANCHORS or (op in ("Gather", "GatherElements") and node.inputs[0] is not None
                                   and _is_constant(node.inputs[0]) and _is_float(node.inputs[0])):
            t = low  # matmuls, attention, embedding lookups
        elif op in MOVE_OPS:
            t = low if low in dynamic else F32
        else:
            t = F32 if (F32 in dynamic or not dynamic) else low
        chosen[node] = t
        for i, v in enumerate(node.outputs):
            if _is_float(v):
                value_type[v] = F32 if i in STAT_OUTPUTS.get(op, ()) else t
    return chosen


class _Caster:
    """Inserts (and reuses) Casts of dynamic values and converted copies of initializers."""

    def __init__(self, model: ir.Model) -> None:
        self.model = model
        self.casts: dict[tuple[ir.Value, ir.DataType], ir.Value] = {}
        self.inserted = 0

    def cast(self, v: ir.Value, to: ir.DataType, before: ir.Node) -> ir.Value:
        key = (v, to)
        if key not in self.casts:
            if _is_constant(v):
                self.casts[key] = self._convert_constant(v, to)
            else:
                out = ir.Value(name=f"{v.name}_{to.name.lower()}", type=ir.TensorType(to), shape=v.shape)
                node = ir.Node("", "Cast", [v], [ir.AttrInt64("to", to.value)], outputs=[out],
                               name=f"{v.name}_cast_{to.name.lower()}")
                self.model.graph.insert_before(before, node)
                self.casts[key] = out
                self.inserted += 1
        return self.casts[key]

    def _convert_constant(self, v: ir.Value, to: ir.DataType) -> ir.Value:
        assert v.const_value is not None
        data = v.const_value.numpy()
        arr = to_low(data, to) if to != F32 else np.asarray(data, dtype=np.float32)
        name = f"{v.name}_{to.name.lower()}"
        out = ir.Value(name=name, type=ir.TensorType(to), shape=v.shape, const_value=ir.Tensor(arr, name=name))
        self.model.graph.register_initializer(out)
        return out


def convert_precision(model: ir.Model, precision: str, keep_fp32: Iterable[str] = DEFAULT_KEEP,
                      keep_io_types: bool = False) -> int:
    """Convert ``model`` in place to ``precision`` (fp16/bf16); returns how many nodes now compute in it."""
    low = low_dtype(precision)
    keep = tuple(keep_fp32)
    ir.passes.common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    model.graph.sort()
    _infer_missing_dtypes(model)
    chosen = _choose(model, low, keep)
    caster = _Caster(model)

    # inputs: the graph's float inputs switch type unless kept; their readers get casts where they differ
    for v in model.graph.inputs:
        if _is_float(v) and not keep_io_types:
            v.dtype = low
    converted_inits = _convert_initializers(model, chosen, low)
    for node in list(model.graph):
        if node not in chosen:
            continue
        t = chosen[node]
        if node.op_type == "Cast" and _std(node) and node.attributes.get_int("to") in (F32.value, low.value):
            node.attributes["to"] = ir.AttrInt64("to", t.value)
        elif node.op_type == "ConstantOfShape" and "value" in node.attributes:
            tensor = node.attributes["value"].as_tensor()
            if tensor.dtype in FLOATS and tensor.dtype != t:
                arr = to_low(tensor.numpy(), t) if t != F32 else tensor.numpy().astype(np.float32)
                node.attributes["value"] = ir.AttrTensor("value", ir.Tensor(arr))
        if node.op_type not in TYPE_AGNOSTIC:
            for i, inp in enumerate(node.inputs):
                if _is_float(inp) and inp.dtype != t:
                    node.replace_input_with(i, caster.cast(inp, t, node))
        for i, out in enumerate(node.outputs):
            if _is_float(out) and i not in STAT_OUTPUTS.get(node.op_type, ()):
                out.dtype = t
    _fix_outputs(model, low, keep_io_types, "logits" in keep)
    ir.passes.common.RemoveUnusedNodesPass()(model)
    n_low = sum(1 for n, t in chosen.items() if t == low)
    log.debug("precision %s: %d nodes low, %d fp32, %d casts inserted, %d initializers converted", precision, n_low,
             len(chosen) - n_low, caster.inserted, converted_inits)
    return n_low


def _convert_initializers(model: ir.Model, chosen: dict[ir.Node, ir.DataType], low: ir.DataType) -> int:
    """Convert float initializers every reader of which computes low (readers of both kinds get a copy later)."""
    n = 0
    for v in list(model.graph.initializers.values()):
        if v.dtype != F32 or v.const_value is None or v.is_graph_output():
            continue
        # uses by nodes outside the graph (a rewriter's discarded dry runs) do not count
        readers = [u.node for u in v.uses() if u.node.graph is model.graph and u.node.op_type not in TYPE_AGNOSTIC]
        if readers and all(chosen.get(r) == low for r in readers):
            name = v.name
            assert name is not None
            arr = to_low(v.const_value.numpy(), low)
            v.const_value = ir.Tensor(arr, name=name)
            v.dtype = low
            n += 1
    return n


def _fix_outputs(model: ir.Model, low: ir.DataType, keep_io: bool, logits_fp32: bool) -> None:
    """Cast graph outputs to their declared type: the low type, or fp32 for kept IO and the logits."""
    for idx, out in enumerate(list(model.graph.outputs)):
        if not _is_float(out):
            continue
        # numpy has no bfloat16: bf16 engines always hand fp32 logits to the sampler
        is_logits = out.name == "logits" and (logits_fp32 or low == ir.DataType.BFLOAT16)
        want = F32 if keep_io or is_logits else low
        if out.dtype == want:
            continue
        name = out.name
        producer = out.producer()
        out.name = f"{name}_{out.dtype.name.lower() if out.dtype else 'src'}"
        final = ir.Value(name=name, type=ir.TensorType(want), shape=out.shape)
        cast = ir.Node("", "Cast", [out], [ir.AttrInt64("to", want.value)], outputs=[final], name=f"{name}_cast")
        if producer is not None:
            model.graph.insert_after(producer, cast)
        else:
            model.graph.insert_before(next(iter(model.graph)), cast)
        model.graph.outputs[idx] = final


@register_pass("precision", kind="precision")
def precision(model: ir.Model, ctx: PassContext) -> int:
    """fp16/bf16 conversion with norms, softmax, residual adds and logits kept in fp32 (no-op for fp32)."""
    cfg = ctx.config
    if cfg.precision == "fp32":
        return 0
    n = convert_precision(model, cfg.precision, cfg.keep_fp32, cfg.keep_io_types)
    ctx.notes["precision"] = cfg.precision
    return n


def emulate_low_precision(model: ir.Model) -> int:
    """Make a fp16/bf16 graph runnable by fp32 kernels while keeping its numerics; returns values rounded.

    Every low-precision value becomes fp32 holding the rounded number: initializers are widened exactly, and each
    low-precision output is followed by ``Cast(low) -> Cast(fp32)``, so every op computes in fp32 on inputs rounded
    as the real graph stores them (what GPU kernels do: low-precision storage, fp32 accumulation). Graph inputs are
    declared fp32 (feed rounded values). For checking bf16 graphs on CPUs, whose ONNX Runtime kernels lack bf16.
    """
    rounded = 0
    for v in list(model.graph.initializers.values()):
        if v.dtype in NUMPY_TYPES and v.const_value is not None:
            v.const_value = ir.Tensor(v.const_value.numpy().astype(np.float32), name=v.name)
            v.dtype = F32
    for v in model.graph.inputs:
        if v.dtype in NUMPY_TYPES:
            v.dtype = F32
    for node in list(model.graph):
        for out in node.outputs:
            low = out.dtype
            if low not in NUMPY_TYPES:
                continue
            uses = [(u.node, u.idx) for u in out.uses()]
            first: ir.Value = out
            name = out.name
            if not (node.op_type == "Cast" and _std(node)):
                out.dtype = F32
                first = ir.Value(name=f"{name}_round", type=ir.TensorType(low), shape=out.shape)
                model.graph.insert_after(node, ir.Node("", "Cast", [out], [ir.AttrInt64("to", low.value)],
                                                       outputs=[first], name=f"{name}_round"))
            wide = ir.Value(name=f"{name}_wide", type=ir.TensorType(F32), shape=out.shape)
            model.graph.insert_after(first.producer() or node,
                                     ir.Node("", "Cast", [first], [ir.AttrInt64("to", F32.value)], outputs=[wide],
                                             name=f"{name}_wide"))
            for user, idx in uses:
                user.replace_input_with(idx, wide)
            for i, g in enumerate(model.graph.outputs):
                if g is out:
                    out.name, wide.name = f"{name}_low", name
                    model.graph.outputs[i] = wide
            rounded += 1
    return rounded
