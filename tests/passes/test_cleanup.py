"""Cleanup's static-shape simplification on hand-written graphs: what folds, what must not, same numbers after."""
from __future__ import annotations

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnx_ir.passes.common  # registers ir.passes.common
import onnxruntime as ort

# Phi-3's rotary: rotary_dim = cos.shape[-1]; x_rot = x[..., :rotary_dim]; cat([f(x_rot), x[..., rotary_dim:]])
ROTARY_SLICES = """
<ir_version: 9, opset_import: ["" : 17]>
g (float[N,4,S,8] x, float[N,S,8] cos) => (float[N,4,S,8] y)
<int64 last = {-1}, int64[1] zero = {0}, int64[1] big = {9223372036854775807}, int64[1] ax = {3}, int64[1] u = {0}>
{
  shp = Shape(cos)
  rd = Gather(shp, last)
  rd1 = Unsqueeze(rd, u)
  xr = Slice(x, zero, rd1, ax)
  xp = Slice(x, rd1, big, ax)
  f = Neg(xr)
  c = Concat<axis=-1>(f, xp)
  y = Relu(c)
}
"""


def _model(text: str) -> ir.Model:
    model = ir.from_proto(onnx.parser.parse_model(text))
    ir.passes.common.ShapeInferencePass()(model)
    ir.passes.common.ShapeInferencePass()(model)
    return model


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(ir.to_proto(model).SerializeToString()).run(None, feeds)[0]


def _fold(model: ir.Model) -> int:
    """The registered ``cleanup`` pass itself (folding, static-shape simplification, dead nodes); nodes removed."""
    from trtinfer.passes import PassConfig, PassContext
    from trtinfer.passes.cleanup import cleanup

    return cleanup(model, PassContext(PassConfig(), {}))


def test_static_rotary_dim_folds_and_slices_vanish() -> None:
    model = _model(ROTARY_SLICES)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 4, 3, 8)).astype(np.float32),
             "cos": rng.standard_normal((2, 3, 8)).astype(np.float32)}
    before = _run(model, feeds)
    assert _fold(model) > 0  # Gather(Shape) -> 8; full Slice -> x; empty operand dropped from the Concat
    ops = [n.op_type for n in model.graph]
    assert ops == ["Neg", "Relu"], ops
    np.testing.assert_array_equal(_run(model, feeds), before)


def test_dynamic_dims_are_left_alone() -> None:
    text = ROTARY_SLICES.replace("float[N,S,8] cos", "float[N,S,D] cos")  # rotary_dim unknown until run time
    model = _model(text)
    assert _fold(model) == 0
    assert [n.op_type for n in model.graph].count("Slice") == 2


def test_partial_slice_is_kept() -> None:
    text = ROTARY_SLICES.replace("float[N,S,8] cos", "float[N,S,4] cos")  # rotary_dim 4 of 8: real slices
    model = _model(text.replace("float[N,4,S,8] y", "float[N,4,S,8] y"))
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 4, 2, 8)).astype(np.float32),
             "cos": rng.standard_normal((1, 2, 4)).astype(np.float32)}
    before = _run(model, feeds)
    _fold(model)
    ops = [n.op_type for n in model.graph]
    assert ops.count("Slice") == 2 and "Concat" in ops and "Shape" not in ops  # only the dim became a constant
    np.testing.assert_array_equal(_run(model, feeds), before)
