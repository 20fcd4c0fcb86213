"""calibration.json and TensorRT's calibration.cache: format, round trips, reuse checks."""
from __future__ import annotations

import json

import pytest

from trtinfer.calibration import CalibrationTable, TensorRange, load_table, scale_hex
from trtinfer.calibration.table import hex_amax
from trtinfer.errors import CalibrationError

RANGES = {"/model/layers.0/attn/q_proj/MatMul_input": TensorRange(-3.5, 2.25, 3.5),
          "h": TensorRange(-127.0, 100.0, 127.0), "zero": TensorRange(0.0, 0.0, 0.0)}


def table(method: str = "entropy", ghash: str = "a" * 64) -> CalibrationTable:
    return CalibrationTable(RANGES, method, ghash, "d" * 64, {"seq_len": 128})


def test_scale_hex_is_big_endian_float32_of_amax_over_127():
    assert scale_hex(127.0) == "3f800000"  # scale 1.0
    assert scale_hex(254.0) == "40000000"  # scale 2.0
    assert scale_hex(127.0 / 4) == "3e800000"  # scale 0.25
    assert hex_amax("3f800000") == 127.0


@pytest.mark.parametrize(("method", "algo"), [("entropy", "EntropyCalibration2"), ("minmax", "MinMaxCalibration"),
                                              ("percentile", "MinMaxCalibration")])
def test_trt_table_header_and_lines(tmp_path, method, algo):
    _, cache = table(method).save(tmp_path)
    lines = cache.read_text().splitlines()
    assert lines[0] == f"TRT-100100-{algo}"
    assert lines[2] == "h: 3f800000"
    assert lines[1].startswith("/model/layers.0/attn/q_proj/MatMul_input: ")
    assert len(lines) == 1 + len(RANGES)


def test_json_round_trip_is_exact(tmp_path):
    js, _ = table().save(tmp_path)
    d = json.loads(js.read_text())
    assert (d["format"], d["graph_hash"], d["dataset_hash"], d["method"]) == (1, "a" * 64, "d" * 64, "entropy")
    assert load_table(js) == table()
    assert load_table(tmp_path) == table()  # a folder: calibration.json preferred


def test_trt_cache_round_trip_keeps_the_scales(tmp_path):
    _, cache = table().save(tmp_path)
    back = load_table(cache)
    assert back.method == "entropy" and back.graph_hash == ""
    for name, r in RANGES.items():
        if r.amax:
            assert back.ranges[name].amax == pytest.approx(r.amax, rel=1e-6)
            assert back.ranges[name].min == -back.ranges[name].amax
    assert 0 < back.ranges["zero"].amax < 1e-30  # TensorRT refuses a zero range: the smallest scale is written


def test_reuse_refuses_another_graph_in_one_line(tmp_path):
    table().save(tmp_path)
    t = load_table(tmp_path / "calibration.json")
    t.check("a" * 64, ["h"])
    with pytest.raises(CalibrationError, match="computed for another graph") as e:
        t.check("b" * 64, ["h"])
    assert "\n" not in str(e.value)


def test_trt_cache_without_hash_must_name_every_needed_tensor(tmp_path):
    _, cache = table().save(tmp_path)
    t = load_table(cache)
    t.check("anything", ["h", "zero"])
    with pytest.raises(CalibrationError, match="lacks 4 tensor.*: x1, x2, x3 and 1 more"):
        t.check("anything", ["h", "x1", "x2", "x3", "x4"])


def test_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(CalibrationError, match="does not exist"):
        load_table(tmp_path / "nope.cache")
    with pytest.raises(CalibrationError, match="neither calibration.json nor calibration.cache"):
        load_table(tmp_path)
    bad = tmp_path / "bad.cache"
    bad.write_text("TRT-100100-EntropyCalibration2\nh: zzzz\n")
    with pytest.raises(CalibrationError, match="line 2 is not"):
        load_table(bad)
    bad.write_text("hello\n")
    with pytest.raises(CalibrationError, match="TensorRT calibration header"):
        load_table(bad)
    bad.write_text('{"kind": "other"}')
    with pytest.raises(CalibrationError, match="not a trtinfer calibration.json"):
        load_table(bad)
