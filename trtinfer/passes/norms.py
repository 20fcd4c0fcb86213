"""Norm fusions: decomposed RMSNorm / LayerNorm -> one op, and residual Add + norm -> one Skip*Normalization.

What the TorchScript exporter traces for HF ``LlamaRMSNorm`` (and every RMSNorm like it; Gemma-3's ``1 + w`` weight
is folded to a constant by cleanup)::

    x -Pow(2)-ReduceMean(-1)-Add(eps)-Sqrt-Div(1, .)-Mul(x, .)-Mul(w, .) -> y

becomes ``SimplifiedLayerNormalization(x, w, axis=-1, epsilon, stash_type=1)`` for ONNX Runtime (a contrib op that
lives in the default domain) or ``RMSNormalization`` for TensorRT when the model's opset is >= 23 (the op's first
version; below that TensorRT gets the decomposed form, which it fuses itself).

Then, for ONNX Runtime only, the residual stream::

    h = Add(residual, branch) --+--> SimplifiedLayerNormalization -> y
                                +--> (next residual Add)

becomes ``com.microsoft.SkipSimplifiedLayerNormalization(branch, residual, w)`` whose 4th output is ``h``, so the
residual keeps flowing; the same for ``LayerNormalization`` -> ``SkipLayerNormalization``. Those two rules are
onnxscript's own (``onnxscript.rewriter.ort_fusions.skip_normalization``), which fire on our graphs as they are;
onnxscript's RMSNorm and LayerNorm rules do not (they want ``Reciprocal`` and opset-18 ``ReduceMean`` axes inputs,
the exporter emits ``Div(1, .)`` and the opset-17 ``axes`` attribute), hence our own below.

Expected counts (from the exporter's geometry): every norm of a ``norm: "rms"`` model is an RMSNorm
(``num_norms``: per-layer norms, q/k norms, Gemma's post-norms, the final norm). A pre-norm decoder has two
residual Adds per layer, each feeding a norm (the next layer's input norm, or the final norm after the last layer):
``skip_norm`` = ``2 * num_layers`` on llama, gemma3 (its Adds feed the pre-feedforward and next input norms; the
post-norms sit on the branch) and gpt2 (GPT-2's token + position embedding Add before the first norm is not fused:
its two operands' batch dims cannot be proven equal).
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult

from trtinfer.passes.config import ORT_TARGETS
from trtinfer.passes.registry import PassContext, register_pass

log = logging.getLogger(__name__)

FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
RMS_NORMALIZATION_OPSET = 23  # first opset with a standard RMSNormalization
LAYER_NORMALIZATION_OPSET = 17  # first opset with a standard LayerNormalization


# --- helpers shared by the rules ------------------------------------------------------------------------------------

def default_opset(model: ir.Model) -> int:
    """The model's default-domain opset version (0 when it imports none)."""
    return int(model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0)))


def scalar(v: ir.Value | None) -> float | None:
    """The value of a constant scalar (or one-element) tensor, else None."""
    if v is None or v.const_value is None:
        return None
    arr = np.asarray(v.const_value.numpy())
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def mul(op: Any, a: Any, b: Any) -> Any:
    """``a * b`` in either operand order (the exporter keeps the order of the Python source)."""
    return pattern.OrValue([op.Mul(a, b), op.Mul(b, a)])


def add(op: Any, a: Any, b: Any) -> Any:
    """``a + b`` in either operand order."""
    return pattern.OrValue([op.Add(a, b), op.Add(b, a)])


def _reduces_last_axis(reduce_out: ir.Value, x: ir.Value) -> bool:
    """``reduce_out`` is ReduceMean over the last axis of ``x`` with keepdims (axes as attribute or input)."""
    node = reduce_out.producer()
    if node is None or node.attributes.get_int("keepdims", 1) != 1:
        return False
    axes_attr = node.attributes.get("axes")
    if axes_attr is not None:
        axes = list(axes_attr.as_ints())
    elif len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].const_value is not None:
        axes = [int(a) for a in np.asarray(node.inputs[1].const_value.numpy()).reshape(-1)]
    else:
        return False
    rank = x.shape.rank() if x.shape is not None else None
    return axes == [-1] or (rank is not None and axes == [rank - 1])


def _is_last_dim_vector(v: ir.Value, x: ir.Value) -> bool:
    """``v`` is a 1-D tensor as long as ``x``'s last dim (so it scales the normalized axis and nothing else)."""
    if v.shape is None or v.shape.rank() != 1 or x.shape is None or x.shape.rank() is None:
        return False
    return x.shape.rank() >= 1 and v.shape[0] == x.shape[-1]


def _epsilon_ok(result: MatchResult, x: ir.Value, epsilon: ir.Value) -> MatchResult:
    if x.dtype not in FLOAT_TYPES:
        return result.fail(f"input dtype {x.dtype} is not float16/bfloat16/float32", x)
    eps = scalar(epsilon)
    if eps is None or not 0.0 <= eps < 1.0:
        return result.fail("epsilon is not a small constant scalar", epsilon)
    return result


# --- RMSNorm --------------------------------------------------------------------------------------------------------

class RmsNormFusion(pattern.RewriteRuleClassBase):
    """``Mul(w, x * 1/sqrt(mean(x^2, -1) + eps))`` -> ``SimplifiedLayerNormalization`` | ``RMSNormalization``.

    Matches ``x^2`` as ``Pow(x, 2)`` or ``Mul(x, x)``; the reciprocal as ``Div(1, rms)``, ``Reciprocal(rms)`` or a
    plain ``Div(x, rms)``; both operand orders of every Mul and Add. ``scale_first`` picks ``Mul(w, n)`` vs
    ``Mul(n, w)`` (the root of a pattern cannot be an OrValue).
    """

    def __init__(self, name: str, *, op_type: str, scale_first: bool) -> None:
        super().__init__(name)
        self._op_type = op_type
        self._scale_first = scale_first

    def pattern(self, op: Any, x: Any, scale: Any, epsilon: Any) -> Any:
        square = pattern.OrValue([op.Pow(x, 2.0), op.Mul(x, x)])
        mean_square = op.ReduceMean(square, _allow_other_inputs=True, _outputs=["mean_square"])
        rms = op.Sqrt(add(op, mean_square, epsilon))
        normalized = pattern.OrValue([mul(op, x, op.Div(1.0, rms)), mul(op, x, op.Reciprocal(rms)), op.Div(x, rms)])
        return op.Mul(scale, normalized) if self._scale_first else op.Mul(normalized, scale)

    def check(self, context: Any, x: ir.Value, scale: ir.Value,  # type: ignore[override]
              epsilon: ir.Value, mean_square: ir.Value, **_: Any) -> MatchResult:
        result = _epsilon_ok(MatchResult(), x, epsilon)
        if not result:
            return result
        if not _reduces_last_axis(mean_square, x):
            return result.fail("ReduceMean is not over the last axis with keepdims", mean_square)
        if scale.dtype != x.dtype or not _is_last_dim_vector(scale, x):
            return result.fail("scale is not a 1-D vector of the normalized dim in the input's dtype", scale)
        return result

    def rewrite(self, op: Any, x: ir.Value, scale: ir.Value, epsilon: ir.Value, **_: Any) -> Any:
        eps = scalar(epsilon)
        # ORT's SimplifiedLayerNormalization is a contrib op registered in the default domain
        return getattr(op, self._op_type)(x, scale, axis=-1, epsilon=eps, stash_type=1)


def rms_norm_rules(op_type: str) -> pattern.RewriteRuleSet:
    """RMSNorm rules emitting ``op_type`` (``SimplifiedLayerNormalization`` or ``RMSNormalization``)."""
    return pattern.RewriteRuleSet([RmsNormFusion.rule(f"RmsNorm{i}", op_type=op_type, scale_first=first)
                                   for i, first in enumerate((True, False))])


def _rms_expected(ctx: PassContext) -> int | None:
    norm, n = ctx.geometry.get("norm"), ctx.geometry.get("num_norms")
    if norm is None or n is None:
        return None
    if norm != "rms":
        return 0
    if ctx.config.target == "tensorrt" and ctx.notes.get("opset", 0) < RMS_NORMALIZATION_OPSET:
        return 0
    return int(n)


@register_pass("rms_norm", kind="fusion", expected=_rms_expected)
def rms_norm(model: ir.Model, ctx: PassContext) -> int:
    """Decomposed RMSNorm -> SimplifiedLayerNormalization (ORT) or RMSNormalization (TensorRT, opset >= 23)."""
    opset = ctx.notes["opset"] = default_opset(model)
    if ctx.config.target in ORT_TARGETS:
        op_type = "SimplifiedLayerNormalization"
    elif opset >= RMS_NORMALIZATION_OPSET:
        op_type = "RMSNormalization"
    else:
        log.debug("rms_norm: opset %d < %d has no RMSNormalization; TensorRT gets the decomposed form", opset,
                  RMS_NORMALIZATION_OPSET)
        return 0
    return rms_norm_rules(op_type).apply_to_model(model)


# --- LayerNorm ------------------------------------------------------------------------------------------------------

class LayerNormFusion(pattern.RewriteRuleClassBase):
    """``Mul(w, (x - mean) / sqrt(var + eps))`` over the last axis -> ``LayerNormalization(x, w)``.

    ``var`` is ``mean(d^2)`` with ``d = x - mean(x)`` as ``Pow(d, 2)`` or ``Mul(d, d)``; the division as ``Div``,
    ``Mul(Reciprocal)`` or ``Mul(Div(1, .))``. A following bias Add is folded by :class:`LayerNormBiasFusion`.
    """

    def __init__(self, name: str, *, scale_first: bool) -> None:
        super().__init__(name)
        self._scale_first = scale_first

    def pattern(self, op: Any, x: Any, scale: Any, epsilon: Any) -> Any:
        mean = op.ReduceMean(x, _allow_other_inputs=True, _outputs=["mean"])
        d = op.Sub(x, mean)
        var = op.ReduceMean(pattern.OrValue([op.Pow(d, 2.0), op.Mul(d, d)]), _allow_other_inputs=True,
                            _outputs=["var"])
        std = op.Sqrt(add(op, var, epsilon))
        normalized = pattern.OrValue([op.Div(d, std), mul(op, d, op.Reciprocal(std)), mul(op, d, op.Div(1.0, std))])
        return op.Mul(scale, normalized) if self._scale_first else op.Mul(normalized, scale)

    def check(self, context: Any, x: ir.Value, scale: ir.Value,  # type: ignore[override]
              epsilon: ir.Value, mean: ir.Value, var: ir.Value, **_: Any) -> MatchResult:
        result = _epsilon_ok(MatchResult(), x, epsilon)
        if not result:
            return result
        if not (_reduces_last_axis(mean, x) and _reduces_last_axis(var, x)):
            return result.fail("ReduceMean is not over the last axis with keepdims", mean)
        if scale.dtype != x.dtype or not _is_last_dim_vector(scale, x):
            return result.fail("scale is not a 1-D vector of the normalized dim in the input's dtype", scale)
        return result

    def rewrite(self, op: Any, x: ir.Value, scale: ir.Value, epsilon: ir.Value, **_: Any) -> Any:
        return op.LayerNormalization(x, scale, axis=-1, epsilon=scalar(epsilon), stash_type=1)


class LayerNormBiasFusion(pattern.RewriteRuleClassBase):
    """``Add(LayerNormalization(x, w), b)`` -> ``LayerNormalization(x, w, b)`` (b a vector of the normalized dim)."""

    def __init__(self, name: str, *, bias_first: bool) -> None:
        super().__init__(name)
        self._bias_first = bias_first

    def pattern(self, op: Any, x: Any, scale: Any, bias: Any) -> Any:
        normalized = op.LayerNormalization(x, scale, _outputs=["normalized"])
        return op.Add(bias, normalized) if self._bias_first else op.Add(normalized, bias)

    def check(self, context: Any, x: ir.Value, bias: ir.Value,  # type: ignore[override]
              normalized: ir.Value, **_: Any) -> MatchResult:
        result = MatchResult()
        node = normalized.producer()
        rank = x.shape.rank() if x.shape is not None else None
        if node is None or node.attributes.get_int("axis", -1) not in (-1, -1 if rank is None else rank - 1):
            return result.fail("LayerNormalization does not normalize the last axis")
        if bias.dtype != x.dtype or not _is_last_dim_vector(bias, x):
            return result.fail("bias is not a 1-D vector of the normalized dim", bias)
        return result

    def rewrite(self, op: Any, x: ir.Value, scale: ir.Value, bias: ir.Value, normalized: ir.Value, **_: Any) -> Any:
        node = normalized.producer()
        assert node is not None
        return op.LayerNormalization(x, scale, bias, **{k: a.value for k, a in node.attributes.items()})


def layer_norm_rules() -> pattern.RewriteRuleSet:
    """Decomposed LayerNorm -> ``LayerNormalization`` (no bias yet)."""
    return pattern.RewriteRuleSet([LayerNormFusion.rule(f"LayerNorm{i}", scale_first=first)
                                   for i, first in enumerate((True, False))])


def layer_norm_bias_rules() -> pattern.RewriteRuleSet:
    """Bias Add after a bias-less ``LayerNormalization`` -> its bias input."""
    return pattern.RewriteRuleSet([LayerNormBiasFusion.rule(f"LayerNormBias{i}", bias_first=first)
                                   for i, first in enumerate((True, False))])


def _layer_expected(ctx: PassContext) -> int | None:
    norm, n = ctx.geometry.get("norm"), ctx.geometry.get("num_norms")
    if norm is None or n is None or "layer_norm.present" not in ctx.notes:
        return None
    if norm != "layer" or ctx.notes.get("opset", 0) < LAYER_NORMALIZATION_OPSET:
        return 0
    # norms the exporter already emitted as LayerNormalization (opset >= 17 exports nn.LayerNorm as one op) are
    # not ours to fuse: we expect the rest
    return max(0, int(n) - int(ctx.notes["layer_norm.present"]))


@register_pass("layer_norm", kind="fusion", expected=_layer_expected)
def layer_norm(model: ir.Model, ctx: PassContext) -> int:
    """Decomposed LayerNorm -> LayerNormalization (all targets, opset >= 17); returns the norms fused.

    A bias Add after a bias-less LayerNormalization is folded into it too, without counting. Norms the exporter
    already emitted as ``LayerNormalization`` are recorded in ``ctx.notes["layer_norm.present"]``, and
    ``expected`` is ``num_norms`` minus those.
    """
    opset = ctx.notes["opset"] = default_opset(model)
    ctx.notes["layer_norm.present"] = sum(1 for n in model.graph if n.op_type == "LayerNormalization"
                                          and n.domain in ("", "ai.onnx"))
    if opset < LAYER_NORMALIZATION_OPSET:
        return 0
    fired = layer_norm_rules().apply_to_model(model)
    layer_norm_bias_rules().apply_to_model(model)
    return fired


# --- residual Add + norm --------------------------------------------------------------------------------------------

def skip_norm_rules() -> pattern.RewriteRuleSet:
    """onnxscript's SkipSimplifiedLayerNormalization and SkipLayerNormalization rules (with/without bias)."""
    from onnxscript.rewriter.ort_fusions import skip_normalization as sn

    return pattern.RewriteRuleSet([*sn.skip_rms_normalization_ruleset.rules,
                                   *sn.skip_layer_normalization_ruleset.rules])


def _skip_expected(ctx: PassContext) -> int | None:
    if ctx.config.target not in ORT_TARGETS:
        return 0
    n = ctx.geometry.get("num_layers")
    return None if n is None or ctx.geometry.get("norm") is None else 2 * int(n)


@register_pass("skip_norm", kind="fusion", expected=_skip_expected)
def skip_norm(model: ir.Model, ctx: PassContext) -> int:
    """Residual Add + (Simplified)LayerNormalization -> com.microsoft Skip(Simplified)LayerNormalization (ORT only).

    The fused op's 4th output is the residual sum, so the stream that continues past the norm keeps its value.
    Runs after ``rms_norm``/``layer_norm``; TensorRT fuses residual + norm itself, so it fires 0 there. The rules
    need both Add operands to carry the same inferred ``[B, S, D]`` shape: where shape inference lost a dim (phi3's
    MLP Slices, inferred before cleanup folded their bounds) that Add stays unfused and the report shows a miss.
    """
    if ctx.config.target not in ORT_TARGETS:
        return 0
    fired = skip_norm_rules().apply_to_model(model)
    if fired and "com.microsoft" not in model.opset_imports:
        model.opset_imports["com.microsoft"] = 1
    return fired
