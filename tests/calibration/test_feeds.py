"""Prefill + teacher-forced decode feeds on tiny export (concat) and optimize (shared_buffer) stages, and a whole
calibration of a stage; the real SmolLM2 graph when it is cached (slow)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from trtinfer.artifact import read_stage
from trtinfer.calibration import (
    CalibrationConfig,
    CalibrationSet,
    calibrate,
    calibrate_stage,
    graph_hash,
    iter_feeds,
    load_table,
    stage_calibration_set,
    weight_matmul_inputs,
)
from trtinfer.errors import CalibrationError
from trtinfer.export import ExportConfig, export
from trtinfer.passes import PassConfig
from trtinfer.passes.optimizer import optimize_stage

WINDOW = (5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 31, 2, 77, 19)  # 10 prompt tokens + 4 decode tokens


@pytest.fixture(scope="module")
def stages(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("calib-stages")
    exp = export(tiny_model_dir("llama"), root / "exp", ExportConfig())
    opt = optimize_stage(exp, root / "opt", PassConfig(max_seq_len=64))
    return {"concat": exp, "shared_buffer": opt}


def presents(stage, cset):
    """The present.* of every run, in order."""
    runs: list[dict[str, np.ndarray]] = []
    feeds = list(iter_feeds(stage, cset, on_outputs=lambda _f, outs: runs.append(
        {k: v for k, v in outs.items() if k.startswith("present.")})))
    return feeds, runs


@pytest.mark.parametrize("layout", ["concat", "shared_buffer"])
def test_decode_kv_equals_a_prefill_of_the_longer_sequence(stages, layout):
    stage = stages[layout]
    assert stage.kv_layout == layout
    feeds, runs = presents(stage, CalibrationSet((WINDOW,), seq_len=10, decode_steps=4, source="t"))
    assert len(feeds) == 5 and feeds[0]["input_ids"].tolist() == [list(WINDOW[:10])]
    assert [f["input_ids"].tolist() for f in feeds[1:]] == [[[t]] for t in WINDOW[10:]]  # teacher forcing
    if layout == "shared_buffer":
        assert [int(f["seqlens_k"][0]) for f in feeds] == [9, 10, 11, 12, 13]
        assert [int(f["total_sequence_length"]) for f in feeds] == [10, 11, 12, 13, 14]
    else:
        assert [f["attention_mask"].shape[1] for f in feeds] == [10, 11, 12, 13, 14]
        assert feeds[0]["past_key_values.0.key"].shape[2] == 0
    if "position_ids" in feeds[0]:
        assert [f["position_ids"].tolist() for f in feeds[1:]] == [[[10]], [[11]], [[12]], [[13]]]
    _, whole = presents(stage, CalibrationSet((WINDOW,), seq_len=14, decode_steps=0, source="t"))
    for name, want in whole[0].items():
        got = runs[-1][name]
        assert got.shape[2] >= 14
        np.testing.assert_allclose(got[:, :, :14], want[:, :, :14], atol=2e-5, err_msg=name)


def test_calibrate_a_stage_runs_each_feed_once_and_saves_a_reusable_table(stages, tmp_path):
    stage = stages["shared_buffer"]
    cfg = CalibrationConfig(method="entropy", num_samples=2, seq_len=12, decode_steps=3)
    table = calibrate_stage(stage, cfg, progress=False)
    names = weight_matmul_inputs(stage)
    assert list(table.ranges) == names and names
    assert all(0 < r.amax <= max(-r.min, r.max) for r in table.ranges.values())
    assert table.graph_hash == graph_hash(stage) == graph_hash(stage.onnx_path)
    table.save(tmp_path)
    again = calibrate_stage(stage, CalibrationConfig(cache_file=tmp_path / "calibration.json"))
    assert again == load_table(tmp_path)
    assert calibrate_stage(stage, CalibrationConfig(cache_file=tmp_path / "calibration.cache")).ranges.keys() == \
        table.ranges.keys()
    with pytest.raises(CalibrationError, match="computed for another graph"):
        calibrate_stage(stages["concat"], CalibrationConfig(cache_file=tmp_path / "calibration.json"))


def test_windows_fit_the_graph(stages):
    """Calibration windows longer than the optimized graph takes (its rotary tables end at its max_seq_len: ONNX
    Runtime refuses a longer sequence) are shortened to it, decode steps kept; an export stage's are as asked. The
    default 128+8 windows calibrate a 64-token graph (they failed in GroupQueryAttention before)."""
    opt, exp = stages["shared_buffer"], stages["concat"]
    assert opt.history["optimize"]["config"]["max_seq_len"] == 64
    short = stage_calibration_set(opt, None, num_samples=2, seq_len=128, decode_steps=8)
    assert (short.seq_len, short.decode_steps) == (56, 8) and {len(w) for w in short.windows} == {64}
    assert stage_calibration_set(opt, None, num_samples=2, seq_len=40, decode_steps=8).seq_len == 40
    assert stage_calibration_set(exp, None, num_samples=2, seq_len=128, decode_steps=8).seq_len == 128
    table = calibrate_stage(opt, CalibrationConfig(num_samples=2), progress=False)
    assert table.ranges and all(r.amax > 0 for r in table.ranges.values())


def test_minmax_over_the_decode_feeds_sees_more_than_the_prefill(stages):
    """The same windows with decode steps can only widen (never narrow) the prefill-only ranges."""
    stage = stages["concat"]
    prefill = calibrate(stage, CalibrationSet((WINDOW[:10],), 10, 0, "t"), progress=False)
    both = calibrate(stage, CalibrationSet((WINDOW,), 10, 4, "t"), progress=False)
    assert all(both[n].min <= prefill[n].min and both[n].max >= prefill[n].max for n in prefill)
    assert any(both[n].amax > prefill[n].amax for n in prefill)


def _smollm2(cache: Path) -> Path | None:
    import json

    root = cache / "optimized"
    for d in sorted(root.glob("*/stage.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        if d.is_symlink():  # a test's whole copy beside a cached stage (tests/tiny_models.py whole_file), not a stage
            continue
        info = json.loads(d.read_text())
        if info.get("architecture") == "llama" and info["history"]["optimize"]["config"].get("precision") == "fp32" \
                and "smollm2" in str(info.get("source", {}).get("model", "")):
            return d.parent
    return None


@pytest.mark.slow
@pytest.mark.parametrize("method", ["minmax", "entropy"])
def test_real_smollm2_graph(method, tmp_path, real_engine, in_user_cache):
    real_engine("smollm2-135m")  # its build leaves the optimized fp32 stage in the user's cache (an empty one too)
    with in_user_cache() as cache:
        folder = _smollm2(cache)
    assert folder is not None, f"the fp32 SmolLM2 build left no optimized stage in {cache}/optimized"
    stage = read_stage(folder)
    t = time.perf_counter()
    table = calibrate_stage(stage, CalibrationConfig(method=method, num_samples=4, seq_len=64, decode_steps=4),
                            progress=False)
    seconds = time.perf_counter() - t
    assert len(table.ranges) == len(weight_matmul_inputs(stage)) > 100
    assert all(np.isfinite(r.amax) and r.amax > 0 for r in table.ranges.values())
    table.save(tmp_path)
    assert (tmp_path / "calibration.cache").read_text().count("\n") == len(table.ranges) + 1
    print(f"{method}: {len(table.ranges)} tensors, 4 samples x (64 + 4 decode): {seconds:.1f} s")
