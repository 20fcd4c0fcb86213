"""Activation fusions: decomposed GELU -> one op; MatMul bias Adds folded into the op that consumes them.

What the TorchScript exporter (opset < 20) traces for the two GELUs::

    exact (nn.GELU):            x -Div(sqrt 2)-Erf-Add(1)-Mul(x, .)-Mul(., 0.5)
    tanh  (GPT-2 gelu_new):     0.5*x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * Pow(x, 3))))
          (gelu_pytorch_tanh):  0.5 * (x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * (x*(x*x))))))

become ``com.microsoft.Gelu`` / ``com.microsoft.FastGelu`` for ONNX Runtime, and the standard ``Gelu``
(``approximate="none"|"tanh"``) for TensorRT when the model's opset is >= 20 (the op's first version; below that
TensorRT gets the decomposed form). onnxscript's GELU rules (``ort_fusions.gelu``, ``ort_fusions.erfgelu``) match
only one operand order of each Mul/Add and fire 0 times on our tiny gpt2 and gemma3 graphs, hence our own.

Then, for ONNX Runtime only (``matmul_bias``), a projection's bias is handed to the fused op after it::

    Add(MatMul(x, W), b)                       --> FastGelu             ==>  FastGelu(MatMul(x, W), b)
    Reshape(Gemm(Reshape(x, [-1, K]), W, b))   --> Gelu                 ==>  BiasGelu(MatMul(x, W), b)
                                               --> Skip*Normalization   ==>  Skip*Normalization(..., bias=b)

GPT-2's ``Conv1D`` layers trace as the Reshape-Gemm-Reshape sandwich; the rewrite drops both Reshapes (checked by
shapes: the result has ``x``'s leading dims). TensorRT fuses biases into its GEMM kernels itself: 0 there.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult

from trtinfer.passes.config import ORT_TARGETS
from trtinfer.passes.norms import FLOAT_TYPES, add, default_opset, mul
from trtinfer.passes.registry import PassContext, register_pass

GELU_OPSET = 20  # first opset with a standard Gelu
_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
# HF activation names (config.hidden_act / hidden_activation / activation_function) that trace as these patterns
GELU_ACTIVATIONS = frozenset({"gelu", "gelu_new", "gelu_pytorch_tanh"})
_FINAL_FORMS = ("half_x", "half_outer", "half_inner")  # where the 0.5 sits in x * 0.5 * (1 + f(x))


def _gelu_tail(op: Any, x: Any, one_plus: Any, form: str, swap: bool) -> Any:
    """The last Mul of ``0.5 * x * one_plus`` in one of its three associations; ``swap`` flips its operands."""
    if form == "half_x":
        a, b = mul(op, x, 0.5), one_plus
    elif form == "half_outer":
        a, b = mul(op, x, one_plus), 0.5
    else:
        a, b = x, mul(op, 0.5, one_plus)
    return op.Mul(b, a) if swap else op.Mul(a, b)


class GeluFusion(pattern.RewriteRuleClassBase):
    """Decomposed exact or tanh GELU -> ``Gelu``/``FastGelu`` (com.microsoft) or ``Gelu(approximate)`` (opset 20).

    ``approximate`` "none" matches ``Erf(x / sqrt 2)`` (or ``x * 1/sqrt 2``); "tanh" matches
    ``Tanh(sqrt(2/pi) * (x + 0.044715 * x^3))`` with ``x^3`` as ``Pow(x, 3)`` or ``x * (x * x)``. Every inner Mul
    and Add matches both operand orders; ``form``/``swap`` pick the root Mul (a pattern root cannot be an OrValue).
    """

    def __init__(self, name: str, *, approximate: str, form: str, swap: bool, standard: bool) -> None:
        super().__init__(name)
        self._approximate = approximate
        self._form = form
        self._swap = swap
        self._standard = standard

    def pattern(self, op: Any, x: Any) -> Any:
        if self._approximate == "none":
            f = op.Erf(pattern.OrValue([op.Div(x, _SQRT_2), mul(op, x, 1.0 / _SQRT_2)]))
        else:
            cube = pattern.OrValue([op.Pow(x, 3.0), mul(op, x, op.Mul(x, x))])
            inner = add(op, x, mul(op, cube, 0.044715))
            f = op.Tanh(mul(op, inner, _SQRT_2_OVER_PI))
        return _gelu_tail(op, x, add(op, f, 1.0), self._form, self._swap)

    def check(self, context: Any, x: ir.Value, **_: Any) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        if x.dtype not in FLOAT_TYPES:
            return result.fail(f"input dtype {x.dtype} is not float16/bfloat16/float32", x)
        return result

    def rewrite(self, op: Any, x: ir.Value, **_: Any) -> Any:
        if self._standard:
            return op.Gelu(x, approximate=self._approximate)
        if self._approximate == "none":
            return op.Gelu(x, _domain="com.microsoft")
        return op.FastGelu(x, _domain="com.microsoft")


def gelu_rules(standard: bool) -> pattern.RewriteRuleSet:
    """Both GELUs in every association: standard ``Gelu`` (``standard``) or the com.microsoft ops."""
    return pattern.RewriteRuleSet([
        GeluFusion.rule(f"Gelu_{approx}_{form}{'_swap' if swap else ''}", approximate=approx, form=form, swap=swap,
                        standard=standard)
        for approx in ("none", "tanh") for form in _FINAL_FORMS for swap in (False, True)])


def _gelu_expected(ctx: PassContext) -> int | None:
    act, n = ctx.geometry.get("activation"), ctx.geometry.get("num_layers")
    if act is None or n is None:
        return None  # the exporter's geometry does not name the activation (yet): unknown
    if str(act).startswith("gelu") and act not in GELU_ACTIVATIONS:
        return None  # gelu_fast & co. trace differently; no rule for them
    if act not in GELU_ACTIVATIONS:
        return 0
    if ctx.config.target not in ORT_TARGETS and ctx.notes.get("opset", 0) < GELU_OPSET:
        return 0
    return int(n)


@register_pass("gelu", kind="fusion", expected=_gelu_expected)
def gelu(model: ir.Model, ctx: PassContext) -> int:
    """Decomposed GELU -> com.microsoft Gelu/FastGelu (ORT) or standard Gelu (TensorRT, opset >= 20).

    ``expected`` is ``num_layers`` (one MLP activation per layer) when the geometry names a GELU ``activation``
    (HF ``hidden_act``: gelu, gelu_new, gelu_pytorch_tanh), 0 for other activations, None when it names none.
    """
    opset = ctx.notes["opset"] = default_opset(model)
    if ctx.config.target in ORT_TARGETS:
        standard = False
    elif opset >= GELU_OPSET:
        standard = True
    else:
        return 0
    fired = gelu_rules(standard).apply_to_model(model)
    if fired and not standard and "com.microsoft" not in model.opset_imports:
        model.opset_imports["com.microsoft"] = 1
    return fired


# --- bias folding ---------------------------------------------------------------------------------------------------

_CONSUMERS = {  # fused op -> (inputs besides the biased one, the op it becomes)
    "FastGelu": ((), "FastGelu"),
    "Gelu": ((), "BiasGelu"),
    "SkipLayerNormalization": (("other", "gamma", "beta"), "SkipLayerNormalization"),
    "SkipSimplifiedLayerNormalization": (("other", "gamma"), "SkipSimplifiedLayerNormalization"),
}


class MatMulBiasFusion(pattern.RewriteRuleClassBase):
    """``consumer(MatMul(x, W) + b)`` -> ``consumer(MatMul(x, W), bias=b)`` for com.microsoft ops with a bias input.

    The biased value is ``Add(MatMul(x, W), b)`` (either order) or GPT-2's ``Reshape(Gemm(Reshape(x, [-1, K]), W,
    b), s)``. ``slot`` is which of a Skip op's first two inputs it is (their sum is symmetric).
    """

    def __init__(self, name: str, *, consumer: str, slot: int = 0) -> None:
        super().__init__(name)
        self._consumer = consumer
        self._slot = slot

    def pattern(self, op: Any, x: Any, w: Any, b: Any, shape_in: Any, shape_out: Any, other: Any, gamma: Any,
                beta: Any) -> Any:
        biased = pattern.OrValue([
            op.Add(op.MatMul(x, w), b),
            op.Add(b, op.MatMul(x, w)),
            op.Reshape(op.Gemm(op.Reshape(x, shape_in, _allow_other_attributes=True, _outputs=["flat"]), w, b,
                               _outputs=["gemm"]), shape_out, _allow_other_attributes=True),
        ], name="biased")
        extra = {"other": other, "gamma": gamma, "beta": beta}
        names = _CONSUMERS[self._consumer][0]
        args = [extra[k] for k in names]
        if names:
            args.insert(self._slot, biased)
            # other inputs: the bias slot, present but empty where onnxscript's skip rules made the node
            return getattr(op, self._consumer)(*args, _domain="com.microsoft", _allow_other_attributes=True,
                                               _allow_other_inputs=True,
                                               _outputs=["out", "mean", "inv_std", "residual"])
        return getattr(op, self._consumer)(biased, _domain="com.microsoft", _outputs=["out"])

    def check(self, context: Any, x: ir.Value, w: ir.Value, b: ir.Value,  # type: ignore[override]
              biased: ir.Value, out: ir.Value,
              shape_in: ir.Value | None = None, flat: ir.Value | None = None, gemm: ir.Value | None = None,
              **_: Any) -> MatchResult:
        # names inside the Gemm alternative are unbound when the Add form matched
        result = MatchResult()
        if x.dtype not in FLOAT_TYPES:
            return result.fail("input is not float", x)
        if w.shape is None or w.shape.rank() != 2 or not isinstance(w.shape[1], int):
            return result.fail("weight is not a 2-D matrix of static width", w)
        if b.const_value is None or b.shape is None or list(b.shape) != [w.shape[1]]:
            return result.fail("bias is not a constant vector of the output width", b)
        node = out.producer()
        assert node is not None
        n_fixed = 1 + len(_CONSUMERS[self._consumer][0])
        if any(v is not None for v in node.inputs[n_fixed:]):
            return result.fail(f"{self._consumer} already has a bias", node)
        if gemm is None:
            return result
        node = gemm.producer()
        assert node is not None
        attrs = node.attributes
        if (attrs.get_float("alpha", 1.0), attrs.get_float("beta", 1.0), attrs.get_int("transA", 0),
                attrs.get_int("transB", 0)) != (1.0, 1.0, 0, 0):
            return result.fail("Gemm scales or transposes its operands", gemm)
        # Reshape(x) to [M, K] with K = x's last dim lists x's rows in order; if the second Reshape gives back x's
        # leading dims, Reshape-Gemm-Reshape is MatMul(x, W) + b
        if x.shape is None or biased.shape is None or x.shape.rank() != biased.shape.rank():
            return result.fail("input or output rank unknown or different", x)
        if not (_const_list(shape_in) == [-1, w.shape[0]] and x.shape[-1] == w.shape[0]) and not (
                flat is not None and flat.shape is not None and flat.shape.rank() == 2
                and flat.shape[1] == x.shape[-1]):
            return result.fail("the first Reshape does not flatten the input to [-1, its last dim]", shape_in)
        if list(x.shape)[:-1] != list(biased.shape)[:-1] or biased.shape[-1] != w.shape[1]:
            return result.fail("the Reshape-Gemm-Reshape does not restore the input's leading dims", biased)
        return result

    def rewrite(self, op: Any, x: ir.Value, w: ir.Value, b: ir.Value, out: ir.Value, other: ir.Value | None = None,
                gamma: ir.Value | None = None, beta: ir.Value | None = None, **_: Any) -> Any:
        mm = op.MatMul(x, w)
        names, fused = _CONSUMERS[self._consumer]
        if not names:
            return getattr(op, fused)(mm, b, _domain="com.microsoft")
        node = out.producer()
        assert node is not None
        eps = node.attributes.get_float("epsilon", 1e-5)
        pair = [mm, other]
        if self._slot:
            pair.reverse()
        rest = [gamma, beta] if beta is not None else [gamma]
        return getattr(op, fused)(*pair, *rest, b, epsilon=eps, _domain="com.microsoft", _outputs=4)


def _const_list(v: ir.Value | None) -> list[int] | None:
    if v is None or v.const_value is None:
        return None
    return [int(i) for i in np.asarray(v.const_value.numpy()).reshape(-1)]


def matmul_bias_rules() -> pattern.RewriteRuleSet:
    """Bias folding into FastGelu, Gelu (-> BiasGelu) and both Skip norms (either of their summed inputs)."""
    rules = [MatMulBiasFusion.rule("FastGeluBias", consumer="FastGelu"),
             MatMulBiasFusion.rule("BiasGelu", consumer="Gelu")]
    for consumer in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
        rules += [MatMulBiasFusion.rule(f"{consumer}Bias{slot}", consumer=consumer, slot=slot) for slot in (0, 1)]
    return pattern.RewriteRuleSet(rules)


@register_pass("matmul_bias", kind="fusion")
def matmul_bias(model: ir.Model, ctx: PassContext) -> int:
    """MatMul + bias Add (or GPT-2's Reshape-Gemm-Reshape) -> the bias input of the next fused op (ORT only).

    Runs after ``gelu`` and ``skip_norm``. No ``expected``: the geometry does not say which projections carry a
    bias (on GPT-2 it is 3 per layer: c_fc into FastGelu, both c_proj into SkipLayerNormalization).
    """
    if ctx.config.target not in ORT_TARGETS:
        return 0
    return matmul_bias_rules().apply_to_model(model)

