"""Each calibrator on ≤3-node graphs fed data of known range; the collect hook; the registry."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper, parser

from trtinfer.calibration import (
    calibrate,
    calibrator_names,
    collect,
    entropy_threshold,
    get_calibrator,
    weight_matmul_inputs,
)
from trtinfer.errors import CalibrationError, ConfigError


def scaled_matmul(tmp_path: Path) -> Path:
    """x -> Mul(x, 2) = h -> MatMul(h, W) -> y: ``h`` is the activation a weight MatMul reads, ``h = 2x``."""
    model = parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N, 4] x) => (float[N, 3] y) {
            two = Constant <value = float {2.0}> ()
            h = Mul(x, two)
            y = MatMul(h, W)
        }""")
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "W")
    model.graph.initializer.append(w)
    onnx.checker.check_model(model)
    path = tmp_path / "scaled_matmul.onnx"
    onnx.save(model, path)
    return path


def feeds(*batches: np.ndarray) -> list[dict[str, np.ndarray]]:
    return [{"x": b.astype(np.float32).reshape(-1, 4)} for b in batches]


def test_registry_lists_methods_and_refuses_unknown_ones():
    assert {"minmax", "percentile", "entropy"} <= set(calibrator_names())
    with pytest.raises(ConfigError, match="unknown calibration method 'kl'; known: entropy, minmax, percentile"):
        get_calibrator("kl")


def test_default_tensors_are_inputs_of_weight_matmuls(tmp_path):
    assert weight_matmul_inputs(scaled_matmul(tmp_path)) == ["h"]


def test_minmax_is_the_exact_range(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    x[3, 1], x[10, 2] = -7.25, 5.5
    r = calibrate(scaled_matmul(tmp_path), feeds(x), method="minmax", progress=False)
    assert list(r) == ["h"]
    assert (r["h"].min, r["h"].max, r["h"].amax) == (-14.5, 11.0, 14.5)


def test_minmax_streaming_over_batches_equals_one_batch(tmp_path):
    path = scaled_matmul(tmp_path)
    x = np.random.default_rng(1).standard_cauchy(size=(400, 4)).astype(np.float32)
    whole = calibrate(path, feeds(x), method="minmax", progress=False)
    parts = calibrate(path, feeds(*np.array_split(x, 7)), method="minmax", progress=False)
    assert whole == parts


def test_percentile_is_the_percentile_of_abs_to_one_bin(tmp_path):
    x = np.random.default_rng(2).normal(size=(50_000, 4)).astype(np.float32)
    r = calibrate(scaled_matmul(tmp_path), feeds(x), method="percentile", percentile=99.9, progress=False)["h"]
    h = 2 * x
    bin_width = np.abs(h).max() / 2048
    assert abs(r.amax - np.percentile(np.abs(h), 99.9)) <= bin_width
    assert (r.min, r.max) == (h.min(), h.max())
    assert r.amax < np.abs(h).max()


def test_percentile_100_is_the_max(tmp_path):
    x = np.random.default_rng(3).normal(size=(1000, 4)).astype(np.float32)
    r = calibrate(scaled_matmul(tmp_path), feeds(x), method="percentile", percentile=100, progress=False)["h"]
    assert r.amax == pytest.approx(np.abs(2 * x).max(), rel=1e-3)


def test_entropy_clips_a_few_huge_outliers(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(100_000, 4)).astype(np.float32)
    x[:3, 0] = [500.0, -480.0, 450.0]  # 3 of 400,000 values, 100x the bulk
    batches = np.array_split(x, 4)
    r = calibrate(scaled_matmul(tmp_path), feeds(*batches), method="entropy", progress=False)["h"]
    assert r.max == 1000.0 and r.min == -960.0
    bulk = np.percentile(np.abs(2 * x), 99.9)
    assert bulk < r.amax < 1000.0 / 4, (bulk, r.amax)


def test_entropy_threshold_of_a_normal_is_a_few_sigma():
    x = np.abs(np.random.default_rng(5).normal(size=1_000_000))
    hist, edges = np.histogram(x, bins=2048, range=(0, x.max()))
    amax = entropy_threshold(hist, edges)
    assert 2.5 < amax < x.max()


def test_collect_hands_every_batch_to_the_hook(tmp_path):
    seen: list[tuple[str, tuple[int, ...]]] = []
    runs = collect(scaled_matmul(tmp_path), feeds(np.ones((2, 4)), np.ones((5, 4))), ["h", "y"],
                   lambda name, arr: seen.append((name, arr.shape)), progress=False)
    assert runs == 2
    assert seen == [("h", (2, 4)), ("y", (2, 3)), ("h", (5, 4)), ("y", (5, 3))]


def test_unknown_tensor_and_no_feeds_are_one_line_errors(tmp_path):
    path = scaled_matmul(tmp_path)
    with pytest.raises(CalibrationError, match="has no tensor nope"):
        calibrate(path, feeds(np.ones((1, 4))), tensors=["nope"], progress=False)
    with pytest.raises(CalibrationError, match="no feeds"):
        calibrate(path, [], progress=False)


def test_graph_without_weight_matmul_needs_explicit_tensors(tmp_path):
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 4])]),
        opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "identity.onnx"
    onnx.save(model, path)
    with pytest.raises(CalibrationError, match="name the tensors explicitly"):
        calibrate(path, feeds(np.ones((1, 4))), progress=False)
    x = np.array([[-3.0, 1.0, 2.0, 0.5]])
    assert calibrate(path, feeds(x), tensors=["y"], progress=False)["y"].amax == 3.0
