"""What TensorRT's ONNX parser can import: the op list, a counter of what a graph uses outside it, and a check pass.

The check runs last in the TensorRT pipeline so an unsupported op (a com.microsoft fusion that slipped in, an op
TensorRT lacks) is reported by name before a build, not as a parser failure halfway through one.
"""
from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from trtinfer.errors import BuildError
from trtinfer.passes.registry import PassContext, register_pass

# Default-domain ops marked "Y" in onnx-tensorrt's docs/operators.md for TensorRT 10.15 (GA 2026-02-02; opsets 9 to
# 24). 10.15 added RMSNormalization, RotaryEmbedding and TensorScatter; the 10.1 list lacks them. Per-op limits
# (e.g. ReduceMean axes must be initializers, LayerNormalization's 1st output only) are not modelled here.
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


def unsupported_ops(model: ir.Model) -> dict[str, int]:
    """Ops of ``model`` (subgraphs included) TensorRT's parser lacks, as ``{op: count}``.

    Ops outside the default domain are all unsupported (no plugins are registered) and keyed ``domain::op``.
    """
    found: Counter[str] = Counter()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain in ("", "ai.onnx"):
            if node.op_type not in TENSORRT_ONNX_OPS:
                found[node.op_type] += 1
        else:
            found[f"{node.domain}::{node.op_type}"] += 1
    return dict(sorted(found.items()))


@register_pass("tensorrt_check", kind="check")
def tensorrt_check(model: ir.Model, ctx: PassContext) -> int:
    """Raise BuildError naming every op TensorRT cannot parse (tensorrt target only); fires 0."""
    if ctx.config.target != "tensorrt":
        return 0
    problems = []
    bad = unsupported_ops(model)
    if bad:
        listed = ", ".join(f"{op} x{n}" for op, n in bad.items())
        problems.append(f"ops TensorRT {TENSORRT_VERSION}'s ONNX parser does not support: {listed}")
    opset = model.opset_imports.get("", 0)
    lo, hi = TENSORRT_OPSETS
    if not lo <= opset <= hi:
        problems.append(f"default opset {opset} is outside TensorRT {TENSORRT_VERSION}'s {lo}..{hi}")
    if problems:
        raise BuildError("graph is not buildable with TensorRT: " + "; ".join(problems)
                         + ". Build it for an onnxruntime target, or disable the pass that introduced these ops "
                         "(trtinfer optimize --list)")
    return 0
