"""GELU and bias-folding fusions: each rule on a hand-written graph, then the whole chain on tiny exports."""
from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest

from trtinfer.passes.activations import gelu, matmul_bias

from ._fusion_checks import (
    ORT,
    TRT,
    apply_pass,
    assert_matches_export,
    assert_same,
    export_once,
    fill,
    floats,
    op_types,
    rand,
    run_passes,
)

D = 8
GELU_CONSTS = ("float half = {0.5}, float three = {3.0}, float c = {0.044715}, float k = {0.7978845608}, "
               "float one = {1.0}, float sqrt2 = {1.4142135}")

# GPT-2's gelu_new as traced: 0.5*x * (1 + tanh(k * (x + c * x^3)))  (8 nodes)
GELU_GPT2 = """
<ir_version: 10, opset_import: ["" : {OPSET}]>
g (float[B,S,8] x) => (float[B,S,8] y)
<{CONSTS}>
{
  h = Mul(x, half)
  p = Pow(x, three)
  m = Mul(p, {C})
  a = Add(x, m)
  s = Mul(a, k)
  t = Tanh(s)
  o = Add(t, one)
  y = Mul(h, o)
}
"""
# nn.GELU(approximate="tanh") (Gemma's gelu_pytorch_tanh) as traced: 0.5 * (x * (1 + tanh(k * (x + c * x*x*x))))
GELU_TANH_TORCH = """
<ir_version: 10, opset_import: ["" : {OPSET}]>
g (float[B,S,8] x) => (float[B,S,8] y)
<{CONSTS}>
{
  xx = Mul(x, x)
  x3 = Mul(x, xx)
  m = Mul(c, x3)
  a = Add(x, m)
  s = Mul(k, a)
  t = Tanh(s)
  o = Add(one, t)
  xo = Mul(x, o)
  y = Mul(half, xo)
}
"""
# nn.GELU() as traced: x * (1 + erf(x / sqrt 2)) * 0.5
GELU_ERF_TORCH = """
<ir_version: 10, opset_import: ["" : {OPSET}]>
g (float[B,S,8] x) => (float[B,S,8] y)
<{CONSTS}>
{
  d = Div(x, {SQRT2})
  e = Erf(d)
  o = Add(e, one)
  xo = Mul(x, o)
  y = Mul(xo, half)
}
"""
GELUS = {"gpt2": (GELU_GPT2, "FastGelu"), "tanh_torch": (GELU_TANH_TORCH, "FastGelu"),
         "erf_torch": (GELU_ERF_TORCH, "Gelu")}


def _gelu(name: str, opset: int = 17, **slots: str) -> str:
    return fill(GELUS[name][0], OPSET=opset, CONSTS=GELU_CONSTS, **{"C": "c", "SQRT2": "sqrt2", **slots})


@pytest.mark.parametrize("name", sorted(GELUS))
def test_gelu_fuses_to_contrib_op(name: str) -> None:
    before, after, fired = apply_pass(_gelu(name), gelu, ORT)
    assert fired == 1
    assert op_types(after) == [GELUS[name][1]] and after.graph.node[0].domain == "com.microsoft"
    assert_same(before, after, {"x": rand(2, 3, D)}, atol=1e-5)


@pytest.mark.parametrize("name, change", [
    ("gpt2", {"C": "half"}),  # 0.5 * x^3: not the tanh approximation
    ("erf_torch", {"SQRT2": "three"}),  # erf(x / 3)
])
def test_gelu_leaves_wrong_constants_alone(name: str, change: dict[str, str]) -> None:
    before, after, fired = apply_pass(_gelu(name, **change), gelu, ORT)
    assert fired == 0 and op_types(after) == op_types(before)


def test_gelu_tensorrt_below_opset_20_stays_decomposed() -> None:
    before, after, fired = apply_pass(_gelu("gpt2"), gelu, TRT)
    assert fired == 0 and op_types(after) == op_types(before)


@pytest.mark.parametrize("name, approximate", [("gpt2", "tanh"), ("erf_torch", "none")])
def test_gelu_tensorrt_opset_20_is_standard_gelu(name: str, approximate: str) -> None:
    before, after, fired = apply_pass(_gelu(name, opset=20), gelu, TRT)
    assert fired == 1 and op_types(after) == ["Gelu"]
    node = after.graph.node[0]
    assert node.domain == "" and onnx.helper.get_attribute_value(node.attribute[0]) == approximate.encode()
    assert_same(before, after, {"x": rand(2, 3, D)}, atol=1e-5)


# --- bias folding ---------------------------------------------------------------------------------------------------

K, N = 4, 8
WEIGHTS = f"float[{K},{N}] w = {floats(K * N, 1)}, float[{N}] b = {floats(N, 2)}, float[{N}] g = {floats(N, 3, 0.1, 1)}"
FASTGELU_BIAS = f"""
<ir_version: 10, opset_import: ["" : 17, "com.microsoft" : 1]>
f (float[B,S,{K}] x{{EXTRA_IN}}) => (float[B,S,{N}] y{{EXTRA_OUT}})
<{WEIGHTS}>
{{{{
  mm = MatMul(x, w)
  z = {{ADD}}
  y = com.microsoft.{{OP}}(z)
}}}}
"""
# GPT-2's Conv1D before a residual norm: Reshape-Gemm-Reshape back to x's leading dims (7 nodes)
GEMM_SKIP = f"""
<ir_version: 10, opset_import: ["" : 17, "com.microsoft" : 1]>
f (float[B,S,{K}] x, float[B,S,{N}] res) => (float[B,S,{N}] y, float[B,S,{N}] h)
<{WEIGHTS}, float[{N}] beta = {floats(N, 4)}, int64[2] flat = {{{{-1, {K}}}}}, int64[1] n = {{{{{N}}}}},
 int64[1] zero = {{{{0}}}}, int64[1] two = {{{{2}}}}>
{{{{
  sx = Shape(x)
  lead = Slice(sx, zero, two)
  s2 = Concat <axis = 0> (lead, n)
  f = Reshape(x, flat)
  gm = Gemm <{{GEMM_ATTRS}}> (f, w, b)
  r = Reshape(gm, s2)
  y, mean, inv, h = com.microsoft.SkipLayerNormalization <epsilon = 1e-5> (res, r, g, beta)
}}}}
"""
SKIP_SIMPLIFIED_BIAS = f"""
<ir_version: 10, opset_import: ["" : 17, "com.microsoft" : 1]>
f (float[B,S,{K}] x, float[B,S,{N}] res) => (float[B,S,{N}] y, float[B,S,{N}] h)
<{WEIGHTS}>
{{{{
  mm = MatMul(x, w)
  z = Add(mm, b)
  y, mean, inv, h = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 1e-6> (z, res, g)
}}}}
"""


def _fastgelu(**slots: str) -> str:
    return fill(FASTGELU_BIAS, **{"EXTRA_IN": "", "EXTRA_OUT": "", "ADD": "Add(mm, b)", "OP": "FastGelu", **slots})


@pytest.mark.parametrize("op, add, fused", [("FastGelu", "Add(mm, b)", "FastGelu"), ("Gelu", "Add(b, mm)", "BiasGelu")])
def test_bias_folds_into_gelu(op: str, add: str, fused: str) -> None:
    before, after, fired = apply_pass(_fastgelu(OP=op, ADD=add), matmul_bias, ORT)
    assert fired == 1 and op_types(after) == ["MatMul", fused]
    assert list(after.graph.node[1].input)[1] == "b"
    assert_same(before, after, {"x": rand(2, 3, K)})


@pytest.mark.parametrize("slots", [
    {"EXTRA_IN": f", float[{N}] bias_in", "ADD": "Add(mm, bias_in)"},  # bias not a constant
    {"EXTRA_OUT": f", float[B,S,{N}] z"},  # biased value used elsewhere too
])
def test_bias_fold_leaves_unsafe_cases_alone(slots: dict[str, str]) -> None:
    before, after, fired = apply_pass(_fastgelu(**slots), matmul_bias, ORT)
    assert fired == 0 and op_types(after) == op_types(before)


def test_bias_folds_gemm_sandwich_into_skip_layer_norm() -> None:
    before, after, fired = apply_pass(fill(GEMM_SKIP, GEMM_ATTRS="alpha = 1.0"), matmul_bias, ORT)
    assert fired == 1 and op_types(after) == ["MatMul", "SkipLayerNormalization"]
    assert list(after.graph.node[1].input) == ["res", after.graph.node[0].output[0], "g", "beta", "b"]
    assert_same(before, after, {"x": rand(2, 3, K), "res": rand(2, 3, N, seed=1)})


def test_bias_fold_leaves_scaled_gemm_alone() -> None:
    before, after, fired = apply_pass(fill(GEMM_SKIP, GEMM_ATTRS="alpha = 2.0"), matmul_bias, ORT)
    assert fired == 0 and op_types(after) == op_types(before)


def test_bias_folds_into_skip_simplified_layer_norm() -> None:
    before, after, fired = apply_pass(fill(SKIP_SIMPLIFIED_BIAS), matmul_bias, ORT)
    assert fired == 1 and op_types(after) == ["MatMul", "SkipSimplifiedLayerNormalization"]
    assert_same(before, after, {"x": rand(2, 3, K), "res": rand(2, 3, N, seed=1)})


def test_bias_fold_is_ort_only() -> None:
    before, after, fired = apply_pass(_fastgelu(), matmul_bias, TRT)
    assert fired == 0 and op_types(after) == op_types(before)


# --- tiny exports ---------------------------------------------------------------------------------------------------

CHAIN = ("rms_norm", "layer_norm", "skip_norm", "gelu", "matmul_bias")
# HF's activation name per arch: what the exporter's geometry would carry as "activation"
ACTIVATIONS = {"llama": "silu", "gemma3": "gelu_pytorch_tanh", "gpt2": "gelu_new"}
BIASES_FOLDED = {"llama": 0, "gemma3": 0, "gpt2": 6}  # GPT-2: c_fc -> FastGelu, attn and mlp c_proj -> SkipLN, x2


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    """``exports(arch)`` -> the tiny model's exported ``model.onnx`` (once per session)."""
    return lambda arch: export_once(arch, tiny_model_dir, tmp_path_factory)


@pytest.mark.parametrize("arch", sorted(ACTIVATIONS))
def test_tiny_export_activations_fire_as_expected_and_match(arch: str, exports) -> None:
    path = exports(arch)
    exported = json.loads((path.parent / "stage.json").read_text())["geometry"]
    geometry = {**exported, "activation": ACTIVATIONS[arch]}
    model, counts = run_passes(path, ORT, CHAIN, geometry)
    assert counts["gelu"][0] == counts["gelu"][1] == (0 if arch == "llama" else geometry["num_layers"])
    assert counts["matmul_bias"][0] == BIASES_FOLDED[arch]
    ops = Counter(n.op_type for n in model.graph)
    assert "Tanh" not in ops
    if arch == "gpt2":
        assert all(len(n.inputs) == 2 for n in model.graph if n.op_type == "FastGelu")
        assert all(n.inputs[4] is not None for n in model.graph if n.op_type == "SkipLayerNormalization")
    assert_matches_export(path, model)
