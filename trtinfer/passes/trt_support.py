"""What TensorRT's ONNX parser imports, node by node: the op list, :func:`tensorrt_problems` and the check pass.

:func:`tensorrt_problems` lists every node TensorRT 10.15's parser would reject, with the reason: an op outside its
list or outside the default domain (``com.microsoft`` fusions: no plugins are registered), a default opset outside
9..24, a tensor type TensorRT lacks, or an op restriction stated in onnx-tensorrt's ``docs/operators.md``
(github.com/onnx/onnx-tensorrt, TensorRT 10.15 GA) that reads off the graph (:data:`OP_CHECKS`), such as initializer
``axes`` or Q/DQ zero points, which must be zero (TensorRT quantizes symmetrically). INT4 blocks (64 or 128, along one
of the last two axes) follow TensorRT's guide, docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/
quantized-types-schemes.html. DOUBLE passes: the parser demotes it to FLOAT. Shapes and types the graph does not
record pass, so no problems means no known obstacle, not a guaranteed build. Only small constants are read (axes, K,
zero points), never weights. The ``tensorrt_check`` pass, last in the TensorRT pipeline, raises them as one
BuildError before a build; ``trtinfer inspect DIR --target tensorrt`` prints them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from trtinfer.errors import BuildError
from trtinfer.passes.registry import PassContext, register_pass

# Default-domain ops marked "Y" in onnx-tensorrt's docs/operators.md for TensorRT 10.15 (GA 2026-02-02; opsets 9 to
# 24). 10.15 added RMSNormalization, RotaryEmbedding and TensorScatter; the 10.1 list lacks them.
TENSORRT_VERSION = "10.15"
TENSORRT_OPSETS = (9, 24)
TENSORRT_ONNX_OPS: frozenset[str] = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "ArgMax", "ArgMin", "Asin", "Asinh", "Atan", "Atanh", "Attention",
    "AveragePool", "BatchNormalization", "BlackmanWindow", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Concat",
    "Constant", "ConstantOfShape", "Conv", "ConvTranspose", "Cos", "Cosh", "CumSum", "DeformConv", "DepthToSpace",
    "DequantizeLinear", "Div", "Dropout", "Einsum", "Elu", "Equal", "Erf", "Exp", "Expand", "EyeLike", "Flatten",
    "Floor", "Gather", "GatherElements", "GatherND", "Gelu", "Gemm", "GlobalAveragePool", "GlobalLpPool",
    "GlobalMaxPool", "Greater", "GreaterOrEqual", "GridSample", "GroupNormalization", "GRU", "HammingWindow",
    "HannWindow", "HardSigmoid", "HardSwish", "Hardmax", "Identity", "If", "ImageScaler", "InstanceNormalization",
    "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log", "LogSoftmax", "Loop", "LRN",
    "LSTM", "LpNormalization", "LpPool", "MatMul", "Max", "MaxPool", "Mean", "MeanVarianceNormalization", "Min", "Mish",
    "Mod", "Mul", "Neg", "NonMaxSuppression", "NonZero", "Not", "OneHot", "Or", "Pad", "ParametricSoftplus", "Pow",
    "PRelu", "QuantizeLinear", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Range",
    "Reciprocal", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
    "ReduceProd", "ReduceSum", "ReduceSumSquare", "Relu", "Reshape", "Resize", "ReverseSequence", "RMSNormalization",
    "RNN", "RoiAlign", "RotaryEmbedding", "Round", "STFT", "ScaledTanh", "Scan", "Scatter", "ScatterElements",
    "ScatterND", "Selu", "Shape", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Size", "Slice", "Softmax", "Softplus",
    "Softsign", "SpaceToDepth", "Split", "Sqrt", "Squeeze", "Sub", "Sum", "Tan", "Tanh", "TensorScatter",
    "ThresholdedRelu", "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Upsample", "Where", "Xor",
})
_T = ir.DataType
#: the data types operators.md lists (DOUBLE is demoted to FLOAT, clamped to +-FLT_MAX)
TENSORRT_DTYPES = frozenset({_T.FLOAT, _T.FLOAT16, _T.BFLOAT16, _T.DOUBLE, _T.FLOAT8E4M3FN, _T.FLOAT4E2M1, _T.INT32,
                             _T.INT64, _T.INT8, _T.INT4, _T.UINT8, _T.BOOL})
#: what TensorRT quantizes to (Q/DQ; the parser reads a UINT8 zero point as INT8)
QUANTIZED_DTYPES = (_T.INT8, _T.INT4, _T.FLOAT8E4M3FN, _T.FLOAT4E2M1)
INT4_BLOCKS = (64, 128)
_READ_LIMIT = 1 << 20  # elements: axes, K and zero points are read, weight matrices never

Check = Callable[[ir.Node], "str | None"]


@dataclass(frozen=True)
class Problem:
    """Why TensorRT's parser would reject a node: its name (``<output>`` when unnamed), ``op`` (``domain::op`` outside
    the default domain) and the reason. Graph-wide problems (the opset) name ``(model)``."""

    node: str
    op: str
    reason: str

    def __str__(self) -> str:
        return f"{self.node} ({self.op}): {self.reason}"


def _in(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if i < len(node.inputs) else None


def _attr(node: ir.Node, name: str, default: Any) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


def _shape(node: ir.Node, i: int = 0) -> ir.Shape | None:
    return None if (v := _in(node, i)) is None else v.shape


def _is_const(v: ir.Value) -> bool:
    p = v.producer()
    return v.const_value is not None or (p is not None and p.op_type == "Constant")


def _read(v: ir.Value) -> np.ndarray | None:
    """The value of a small initializer or Constant output; None for anything else, or when its data is absent."""
    t, p = v.const_value, v.producer()
    if t is None and p is not None and p.op_type == "Constant" and len(p.attributes) == 1:
        a = next(iter(p.attributes.values()))
        if a.name in ("value_int", "value_ints", "value_float", "value_floats"):
            return np.asarray(a.value)
        t = a.value if a.name == "value" else None
    try:
        return None if t is None or t.size > _READ_LIMIT else t.numpy()
    except OSError:  # external data not beside the graph: the value is unknown
        return None


# --- per-op checks: factories for the kinds of restriction operators.md states, then the few that need own code ----

def _constant(i: int, what: str, strict: bool = True) -> Check:
    """Input ``i``, when given, must be an initializer (or a Constant's output); not ``strict``: "must resolve to a
    constant", which only a graph input surely fails (a computed one may fold at build time)."""
    def check(n: ir.Node) -> str | None:
        if (v := _in(n, i)) is None or (_is_const(v) if strict else not v.is_graph_input()):
            return None
        found = "graph input" if v.is_graph_input() else "computed tensor"
        return f"`{what}` must be {'an initializer' if strict else 'a constant'}, found {found} '{v.name}'"
    return check


def _attr_in(name: str, allowed: tuple[Any, ...], default: Any) -> Check:
    return lambda n: (None if (v := _attr(n, name, default)) in allowed
                      else f"{name}={v!r} is unsupported (TensorRT takes {', '.join(map(repr, allowed))})")


def _no_attrs(*names: str) -> Check:
    return lambda n: (f"attribute {', '.join(found)} unsupported" if (found := [a for a in names if a in n.attributes])
                      else None)


def _all_ones(name: str) -> Check:
    return lambda n: (None if all(d == 1 for d in _attr(n, name, ()))
                      else f"{name}={list(_attr(n, name, ()))}, TensorRT takes all ones")


def _attr_len(name: str, lengths: tuple[int, ...], what: str) -> Check:
    return lambda n: (None if len(v := _attr(n, name, ())) in lengths or not v
                      else f"{what}, found {len(v)}D ({name}={list(v)})")


def _ranks(rank: int, *inputs: tuple[int, str]) -> Check:
    def check(n: ir.Node) -> str | None:
        bad = [f"{what} {len(s)}D" for i, what in inputs if (s := _shape(n, i)) is not None and len(s) != rank]
        return f"must be {rank}D: {', '.join(bad)}" if bad else None
    return check


def _no_inputs(first: int, *names: str) -> Check:
    return lambda n: (f"input {', '.join(given)} unsupported"
                      if (given := [w for i, w in enumerate(names, first) if _in(n, i) is not None]) else None)


def _outputs_at_most(count: int, what: str) -> Check:
    return lambda n: f"{what}; the node declares {len(n.outputs)} outputs" if len(n.outputs) > count else None


def _input_dtype(i: int, dtype: ir.DataType, what: str) -> Check:
    return lambda n: (f"`{what}` must be {dtype.name}, found {v.dtype.name}"
                      if (v := _in(n, i)) is not None and v.dtype not in (None, dtype) else None)


def _static(whole: bool) -> Check:
    """The input's dimensions (``whole``), or its ``axis`` dimension, must be static."""
    def check(n: ir.Node) -> str | None:
        if (shape := _shape(n)) is None or not -len(shape) <= (axis := _attr(n, "axis", -1)) < len(shape):
            return None
        if all(isinstance(d, int) for d in (shape if whole else [shape[axis]])):
            return None
        return f"input shape {shape} must be static" if whole else f"input dimension {axis} ({shape[axis]}) must be static"
    return check


def _same_activations(per_direction: int) -> Check:
    """Bidirectional RNN/GRU/LSTM: both directions must use the same activation functions."""
    def check(n: ir.Node) -> str | None:
        acts = list(_attr(n, "activations", ()))
        if _attr(n, "direction", "forward") != "bidirectional" or len(acts) != 2 * per_direction:
            return None
        fwd, rev = acts[:per_direction], acts[per_direction:]
        return None if fwd == rev else f"bidirectional activations differ: forward {fwd}, reverse {rev}"
    return check


def _dropout_off(n: ir.Node) -> str | None:
    if (v := _in(n, 2)) is None or (_is_const(v) and ((arr := _read(v)) is None or not arr.any())):
        return None
    return f"`training_mode` must be an initializer holding False, found '{v.name}'"


def _topk_k(n: ir.Node) -> str | None:
    k = _read(v) if (v := _in(n, 1)) is not None else None
    return f"K={int(k.max())}, TensorRT takes K < 3840" if k is not None and k.size and k.max() >= 3840 else None


def _resize_axes(n: ir.Node) -> str | None:
    """With computed ``scales``, ``axes`` must be 0..rank-1."""
    scales, axes, shape = _in(n, 2), _attr(n, "axes", None), _shape(n)
    if scales is None or _is_const(scales) or axes is None:
        return None
    iota = list(range(len(shape) if shape is not None else len(axes)))
    return None if list(axes) == iota else f"with computed scales, axes must be {iota}, found {list(axes)}"


def _if_branches(n: ir.Node) -> str | None:
    then, other = _attr(n, "then_branch", None), _attr(n, "else_branch", None)
    for a, b in zip(then.outputs if then else (), other.outputs if other else ()):
        if a.name == b.name:
            return f"branch outputs must have different names, both are '{a.name}'"
        if a.shape is not None and b.shape is not None and len(a.shape) != len(b.shape):
            return f"branch outputs must have the same rank: '{a.name}' {len(a.shape)}D, '{b.name}' {len(b.shape)}D"
    return None


def _even_pads(n: ir.Node) -> str | None:
    pads = list(_attr(n, "pads", ()))
    return None if pads[:len(pads) // 2] == pads[len(pads) // 2:] else f"pads {pads}: begin and end must be equal"


def _real_signal(n: ir.Node) -> str | None:
    shape = _shape(n)
    return "input must be real-valued (last dimension 1)" if shape is not None and shape[-1:] == (2,) else None


def _cast_to(n: ir.Node) -> str | None:
    """Cast whose output type is not recorded: its ``to`` attribute."""
    to = _T(_attr(n, "to", _T.FLOAT))
    return f"casts to {to.name}, a type TensorRT lacks" if n.outputs[0].dtype is None and to not in TENSORRT_DTYPES else None


def _zero_point(n: ir.Node) -> str | None:
    if (zp := _in(n, 2)) is None or (_is_const(zp) and ((arr := _read(zp)) is None or not arr.astype(np.float32).any())):
        return None
    return f"zero point '{zp.name}' must be an all-zero initializer: TensorRT quantizes symmetrically"


def _quantized(n: ir.Node) -> str | None:
    """The quantized type (DQ's input; Q's zero point, ``output_dtype`` or output, ONNX's default UINT8) and INT4's
    blocks."""
    x, zp, dq = _in(n, 0), _in(n, 2), n.op_type == "DequantizeLinear"
    dt = next((t for t in (x.dtype if dq and x is not None else None, zp.dtype if zp is not None else None)
               if t is not None), None)
    if dt is None and not dq:
        dt = _T(_attr(n, "output_dtype", 0) or n.outputs[0].dtype or _T.UINT8)
    if dt is not None and dt not in QUANTIZED_DTYPES:
        return f"quantized type {dt.name}, TensorRT takes {', '.join(t.name for t in QUANTIZED_DTYPES)}"
    if dt != _T.INT4:
        return None
    block, axis, rank = _attr(n, "block_size", 0), _attr(n, "axis", 1), len(s) if (s := _shape(n)) else None
    if block not in INT4_BLOCKS:
        return f"INT4 needs blocks of {' or '.join(map(str, INT4_BLOCKS))}, found block_size={block}"
    if rank is not None and (axis + rank if axis < 0 else axis) < rank - 2:
        return f"INT4 blocks must run along one of the last two axes, found axis={axis} of a {rank}D tensor"
    return None


_POOL = (_attr_len("kernel_shape", (2, 3), "2D or 3D pooling only"), _all_ones("dilations"))
#: per-op restrictions of docs/operators.md (TensorRT 10.15) that read off the graph; each check returns a reason or None
def _kv_cache_io(n: ir.Node) -> str | None:
    """TensorScatter becomes the KV-cache update layer, whose cache must be a network input and whose output a network
    output sharing its memory (TensorRT's KVCacheUpdate operator reference)."""
    cache, out = _in(n, 0), n.outputs[0]
    if cache is not None and not cache.is_graph_input():
        return f"past_cache '{cache.name}' must be a graph input (TensorRT updates the KV cache in place)"
    if not out.is_graph_output():
        return f"output '{out.name}' must be a graph output aliasing past_cache (TensorRT's KV-cache update layer)"
    return None


OP_CHECKS: dict[str, tuple[Check, ...]] = {
    "Attention": (_ranks(4, (0, "Q"), (1, "K"), (2, "V"), (3, "attn_mask")),
                  _no_inputs(4, "past_key", "past_value", "nonpad_kv_seqlen"),
                  _outputs_at_most(1, "outputs present_key, present_value and qk_matmul_output are unsupported"),
                  _attr_in("qk_matmul_output_mode", (0,), 0), _attr_in("softcap", (0.0,), 0.0)),
    "AveragePool": _POOL,
    "Cast": (_cast_to,),
    "Constant": (_no_attrs("sparse_value", "value_string", "value_strings"),),
    "CumSum": (_constant(1, "axis"),),
    "DeformConv": (_ranks(4, (0, "input")), _even_pads),
    "DequantizeLinear": (_zero_point, _quantized),
    "Dropout": (_dropout_off,),
    "EyeLike": (_static(whole=True),),
    "GridSample": (_ranks(4, (0, "input")),),
    "GRU": (_same_activations(2),),
    "Hardmax": (_static(whole=False),),
    "If": (_if_branches,),
    "LayerNormalization": (_outputs_at_most(1, "only the first output `Y` is supported"),),
    "LpPool": (_all_ones("dilations"),),
    "LSTM": (_same_activations(3), _attr_in("input_forget", (0,), 0), _attr_in("layout", (0,), 0)),
    "MaxPool": (*_POOL, _outputs_at_most(1, "the `Indices` output is unsupported")),
    "OneHot": (_constant(1, "depth"),),
    "QuantizeLinear": (_zero_point, _quantized),
    **{op: (_constant(1, "axes"),) for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
                                              "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")},
    "Resize": (_attr_in("coordinate_transformation_mode", ("half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn",
                                                           "asymmetric", "align_corners"), "half_pixel"),
               _attr_in("mode", ("nearest", "linear"), "nearest"),
               _attr_in("nearest_mode", ("floor", "ceil", "round_prefer_floor", "round_prefer_ceil"),
                        "round_prefer_floor"),
               _attr_in("keep_aspect_ratio_policy", ("stretch",), "stretch"), _attr_in("antialias", (0,), 0),
               _resize_axes),
    "RNN": (_same_activations(1),),
    "RotaryEmbedding": (_input_dtype(3, _T.INT64, "position_ids"),),
    "ScatterND": (_attr_in("reduction", ("none",), "none"),),
    "STFT": (_constant(1, "frame_step"), _constant(2, "window"), _real_signal),
    "Squeeze": (_constant(1, "axes", strict=False),),
    "TensorScatter": (_ranks(4, (0, "past_cache"), (1, "update")), _attr_in("axis", (-2,), -2),
                      _attr_in("mode", ("linear",), "linear"), _kv_cache_io),
    "TopK": (_attr_in("sorted", (1,), 1), _topk_k),
    "Unsqueeze": (_constant(1, "axes", strict=False),),
}


def _node_reasons(node: ir.Node, functions: Any) -> Iterator[str]:
    if node.op_identifier() in functions:
        return  # a model-local function: the parser imports its body, checked node by node on its own
    if node.domain not in ("", "ai.onnx"):
        kind = "ONNX Runtime contrib op" if node.domain == "com.microsoft" else f"op of domain {node.domain}"
        yield f"{kind}: TensorRT's parser takes default-domain ONNX ops only (no plugins registered)"
        return
    if node.op_type not in TENSORRT_ONNX_OPS:
        yield f"not in TensorRT {TENSORRT_VERSION}'s ONNX operator list"
        return
    bad = {v.name: v.dtype for v in (*node.inputs, *node.outputs) if v is not None and v.dtype is not None
           and v.dtype not in TENSORRT_DTYPES}
    yield from (f"'{name}' is {dt.name}, a type TensorRT lacks" for name, dt in bad.items())
    for check in OP_CHECKS.get(node.op_type, ()):
        if (reason := check(node)) is not None:
            yield reason


def iter_nodes(model: ir.Model) -> Iterator[ir.Node]:
    """The nodes TensorRT's parser imports: the graph's, its subgraphs' (If/Loop/Scan bodies) and those of the local
    functions it calls (once each; the parser inlines them, unused ones it never reads)."""
    seen: set[Any] = set()

    def walk(nodes: Iterable[ir.Node]) -> Iterator[ir.Node]:
        for node in nodes:
            yield node
            if (key := node.op_identifier()) in model.functions and key not in seen:
                seen.add(key)
                yield from walk(ir.traversal.RecursiveGraphIterator(model.functions[key]))
    return walk(ir.traversal.RecursiveGraphIterator(model.graph))


def _op(node: ir.Node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def tensorrt_problems(model: ir.Model) -> list[Problem]:
    """Every node of ``model`` TensorRT's ONNX parser would reject, in graph order, one :class:`Problem` per reason."""
    problems = []
    opset, (lo, hi) = model.opset_imports.get("", 0), TENSORRT_OPSETS
    if not lo <= opset <= hi:
        problems.append(Problem("(model)", "opset_import",
                                f"default opset {opset} is outside TensorRT {TENSORRT_VERSION}'s {lo}..{hi}"))
    for node in iter_nodes(model):
        name = node.name or f"<{next((o.name for o in node.outputs if o.name), '?')}>"
        problems += [Problem(name, _op(node), r) for r in _node_reasons(node, model.functions)]
    return problems


def unsupported_ops(model: ir.Model) -> dict[str, int]:
    """Ops of ``model`` (subgraphs included) TensorRT's parser lacks, as ``{op: count}``.

    Ops outside the default domain are all unsupported (no plugins are registered) and keyed ``domain::op``.
    """
    found = Counter(_op(n) for n in ir.traversal.RecursiveGraphIterator(model.graph)
                    if n.domain not in ("", "ai.onnx") or n.op_type not in TENSORRT_ONNX_OPS)
    return dict(sorted(found.items()))


@register_pass("tensorrt_check", kind="check")
def tensorrt_check(model: ir.Model, ctx: PassContext) -> int:
    """Raise BuildError listing the nodes TensorRT's parser would reject (tensorrt target only); fires 0."""
    if ctx.config.target != "tensorrt":
        return 0
    if problems := tensorrt_problems(model):
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise BuildError(f"graph is not buildable with TensorRT: its {TENSORRT_VERSION} ONNX parser would reject "
                         f"{len({p.node for p in problems})} node(s): {'; '.join(map(str, problems[:10]))}{more}. "
                         "Build for an onnxruntime target, or disable the pass that introduced them (trtinfer "
                         "optimize --list); `trtinfer inspect DIR --target tensorrt` lists them all")
    return 0
