"""Norm fusions: each rule on a hand-written graph (positive, negative, numerics), then on tiny exports."""
from __future__ import annotations

from collections import Counter
from typing import Any

import onnx
import onnx_ir as ir
import pytest

from trtinfer.passes import PassContext
from trtinfer.passes.norms import layer_norm, rms_norm, skip_norm

from ._fusion_checks import (
    ORT,
    TRT,
    apply_pass,
    assert_matches_export,
    assert_same,
    export_once,
    fill,
    op_types,
    rand,
    run_passes,
)

D = 8
W = "{" + ", ".join(str(0.5 + 0.1 * i) for i in range(D)) + "}"
B_ = "{" + ", ".join(str(0.05 * i - 0.2) for i in range(D)) + "}"

# HF LlamaRMSNorm as the TorchScript exporter traces it (7 nodes); the {..} slots vary the form
RMS = f"""
<ir_version: 10, opset_import: ["" : {{OPSET}}]>
rms (float[B,S,{D}] x) => (float[B,S,{D}] y)
<float two = {{2.0}}, float eps = {{1e-6}}, float one = {{1.0}}, float[{D}] w = {W}, int64[1] ax = {{-1}}>
{{
  sq = {{SQUARE}}
  ms = {{REDUCE}}
  mse = Add(ms, eps)
  r = Sqrt(mse)
  {{NORMALIZE}}
  y = {{SCALE}}
}}
"""
RMS_FORMS: dict[str, dict[str, Any]] = {
    "torch": {"OPSET": 17, "SQUARE": "Pow(x, two)", "REDUCE": "ReduceMean <axes = [-1]> (sq)",
              "NORMALIZE": "inv = Div(one, r)\n  n = Mul(x, inv)", "SCALE": "Mul(w, n)"},
    "reciprocal": {"OPSET": 17, "SQUARE": "Mul(x, x)", "REDUCE": "ReduceMean <axes = [2], keepdims = 1> (sq)",
                   "NORMALIZE": "inv = Reciprocal(r)\n  n = Mul(inv, x)", "SCALE": "Mul(n, w)"},
    "div": {"OPSET": 17, "SQUARE": "Pow(x, two)", "REDUCE": "ReduceMean <axes = [-1]> (sq)",
            "NORMALIZE": "n = Div(x, r)", "SCALE": "Mul(n, w)"},
    "opset18_axes_input": {"OPSET": 18, "SQUARE": "Pow(x, two)", "REDUCE": "ReduceMean (sq, ax)",
                           "NORMALIZE": "inv = Div(one, r)\n  n = Mul(x, inv)", "SCALE": "Mul(w, n)"},
}


def _rms(**override: Any) -> str:
    return fill(RMS, **{**RMS_FORMS["torch"], **override})


# --- RMSNorm --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", sorted(RMS_FORMS))
def test_rms_norm_fuses_every_traced_form(form: str) -> None:
    before, after, fired = apply_pass(fill(RMS, **RMS_FORMS[form]), rms_norm, ORT)
    assert fired == 1
    assert op_types(after) == ["SimplifiedLayerNormalization"]
    node = after.graph.node[0]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "" and attrs["axis"] == -1 and attrs["stash_type"] == 1
    assert attrs["epsilon"] == pytest.approx(1e-6)
    assert_same(before, after, {"x": rand(2, 3, D)})


@pytest.mark.parametrize("change", [
    {"REDUCE": "ReduceMean <axes = [1]> (sq)"},  # mean over the sequence, not the hidden dim
    {"SQUARE": "Pow(x, one)"},  # mean of x, not of x^2
    {"SCALE": "Mul(n, n)"},  # no 1-D scale: squares the normalized value
])
def test_rms_norm_leaves_lookalikes_alone(change: dict[str, str]) -> None:
    before, after, fired = apply_pass(_rms(**change), rms_norm, ORT)
    assert fired == 0 and op_types(after) == op_types(before)


def test_rms_norm_needs_constant_epsilon() -> None:
    text = _rms().replace("(float[B,S,8] x)", "(float[B,S,8] x, float eps)").replace("float eps = {1e-6}, ", "")
    before, after, fired = apply_pass(text, rms_norm, ORT)
    assert fired == 0 and op_types(after) == op_types(before)


def test_rms_norm_tensorrt_below_opset_23_stays_decomposed() -> None:
    before, after, fired = apply_pass(_rms(), rms_norm, TRT)
    assert fired == 0 and op_types(after) == op_types(before)


def test_rms_norm_tensorrt_opset_23_is_rmsnormalization() -> None:
    before, after, fired = apply_pass(fill(RMS, **{**RMS_FORMS["opset18_axes_input"], "OPSET": 23}), rms_norm, TRT)
    assert fired == 1 and op_types(after) == ["RMSNormalization"]
    assert_same(before, after, {"x": rand(2, 3, D)})


# --- LayerNorm ------------------------------------------------------------------------------------------------------

# nn.LayerNorm written out (9 nodes): what older opsets and hand-rolled norms trace to
LAYER = f"""
<ir_version: 10, opset_import: ["" : {{OPSET}}]>
ln (float[B,S,{D}] x) => (float[B,S,{D}] y)
<float two = {{2.0}}, float eps = {{1e-5}}, float[{D}] w = {W}, float[{D}] b = {B_}>
{{
  mean = ReduceMean <axes = [-1]> (x)
  d = {{SUB}}
  dd = Pow(d, two)
  var = ReduceMean <axes = [-1]> (dd)
  ve = Add(var, eps)
  sd = Sqrt(ve)
  n = Div(d, sd)
  s = Mul(n, w)
  y = Add(b, s)
}}
"""


def test_layer_norm_fuses_with_bias() -> None:
    before, after, fired = apply_pass(fill(LAYER, OPSET=17, SUB="Sub(x, mean)"), layer_norm, ORT)
    assert fired == 1 and op_types(after) == ["LayerNormalization"]
    assert list(after.graph.node[0].input) == ["x", "w", "b"]
    assert_same(before, after, {"x": rand(2, 3, D)})


def test_layer_norm_same_for_tensorrt() -> None:
    _, after, fired = apply_pass(fill(LAYER, OPSET=17, SUB="Sub(x, mean)"), layer_norm, TRT)
    assert fired == 1 and op_types(after) == ["LayerNormalization"]


def test_layer_norm_leaves_negated_deviation_alone() -> None:
    before, after, fired = apply_pass(fill(LAYER, OPSET=17, SUB="Sub(mean, x)"), layer_norm, ORT)
    assert fired == 0 and op_types(after) == op_types(before)


def test_layer_norm_needs_opset_17() -> None:
    before, after, fired = apply_pass(fill(LAYER, OPSET=16, SUB="Sub(x, mean)"), layer_norm, ORT)
    assert fired == 0 and op_types(after) == op_types(before)


# --- residual Add + norm --------------------------------------------------------------------------------------------

# a residual Add feeding an RMSNorm, the sum flowing on as the next residual (8 nodes)
SKIP_RMS = f"""
<ir_version: 10, opset_import: ["" : 17]>
skip (float[{{RES}}] res, float[B,S,{D}] branch) => (float[B,S,{D}] y, float[B,S,{D}] h)
<float two = {{2.0}}, float eps = {{1e-6}}, float one = {{1.0}}, float[{D}] w = {W}>
{{
  h = Add(res, branch)
  sq = Pow(h, two)
  ms = ReduceMean <axes = [-1]> (sq)
  mse = Add(ms, eps)
  r = Sqrt(mse)
  inv = Div(one, r)
  n = Mul(h, inv)
  y = Mul(w, n)
}}
"""
SKIP_LAYER = f"""
<ir_version: 10, opset_import: ["" : 17]>
skip (float[B,S,{D}] res, float[B,S,{D}] branch) => (float[B,S,{D}] y, float[B,S,{D}] h)
<float[{D}] w = {W}, float[{D}] b = {B_}>
{{
  h = Add(branch, res)
  y = LayerNormalization <axis = -1, epsilon = 1e-5> (h, w, b)
}}
"""


def _rms_then_skip(model: ir.Model, ctx: PassContext) -> int:
    assert rms_norm(model, ctx) == 1
    return skip_norm(model, ctx)


def test_skip_rms_norm_keeps_the_residual_sum() -> None:
    before, after, fired = apply_pass(fill(SKIP_RMS, RES=f"B,S,{D}"), _rms_then_skip, ORT)
    assert fired == 1 and op_types(after) == ["SkipSimplifiedLayerNormalization"]
    assert after.graph.node[0].domain == "com.microsoft"
    assert_same(before, after, {"res": rand(2, 3, D), "branch": rand(2, 3, D, seed=1)})


def test_skip_layer_norm_keeps_the_residual_sum() -> None:
    before, after, fired = apply_pass(SKIP_LAYER, skip_norm, ORT)
    assert fired == 1 and op_types(after) == ["SkipLayerNormalization"]
    assert_same(before, after, {"res": rand(2, 3, D), "branch": rand(2, 3, D, seed=1)})


def test_skip_norm_leaves_broadcast_add_alone() -> None:
    # a [S, D] operand broadcast over the batch is not a residual stream
    _, after, fired = apply_pass(fill(SKIP_RMS, RES=f"S,{D}"), _rms_then_skip, ORT)
    assert fired == 0 and op_types(after) == ["Add", "SimplifiedLayerNormalization"]


def test_skip_norm_is_ort_only() -> None:
    before, after, fired = apply_pass(SKIP_LAYER, skip_norm, TRT)
    assert fired == 0 and op_types(after) == op_types(before)


# --- tiny exports ---------------------------------------------------------------------------------------------------

NORM_PASSES = ("rms_norm", "layer_norm", "skip_norm")


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    """``exports(arch)`` -> the tiny model's exported ``model.onnx`` (once per session)."""
    return lambda arch: export_once(arch, tiny_model_dir, tmp_path_factory)


# what the tiny graphs hold, and so what the geometry-derived expectations must come to
TINY_NORM_COUNTS = {
    "llama": {"rms_norm": 5, "layer_norm": 0, "skip_norm": 4},  # 2 layers x 2 norms + final; 2 residuals/layer
    "gemma3": {"rms_norm": 19, "layer_norm": 0, "skip_norm": 6},  # 3 layers x (4 + q/k norms) + final
    "gpt2": {"rms_norm": 0, "layer_norm": 0, "skip_norm": 4},  # the exporter emits LayerNormalization itself
}


@pytest.mark.parametrize("arch", sorted(TINY_NORM_COUNTS))
def test_tiny_export_norms_fire_as_expected_and_match(arch: str, exports) -> None:
    path = exports(arch)
    model, counts = run_passes(path, ORT, NORM_PASSES)
    assert {k: fired for k, (fired, _) in counts.items()} == TINY_NORM_COUNTS[arch]
    assert all(fired == expected for fired, expected in counts.values()), counts
    ops = Counter(n.op_type for n in model.graph)
    assert "Sqrt" not in ops and "ReduceMean" not in ops  # nothing left decomposed
    assert_matches_export(path, model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_export_tensorrt_keeps_standard_ops(arch: str, exports) -> None:
    model, counts = run_passes(exports(arch), TRT, NORM_PASSES)
    assert counts["skip_norm"] == (0, 0) and counts["rms_norm"] == (0, 0)  # opset 17: no RMSNormalization yet
    assert not any(n.domain not in ("", "ai.onnx") or n.op_type.startswith("Simplified") for n in model.graph)
