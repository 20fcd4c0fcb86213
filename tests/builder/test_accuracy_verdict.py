"""A quantized build's verdict includes its accuracy: the compiled engine scored on held-out text against the fp32
graph, within the precision's perplexity bound or the build fails in one line (and leaves no engine)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from trtinfer.artifact import ONNX_NAME, read_stage, write_stage
from trtinfer.builder import BuildConfig, build
from trtinfer.errors import BuildError, ConfigError
from trtinfer.quantization import QuantConfig, quantize_stage
from trtinfer.quantization.accuracy import HELDOUT_NAME, PERPLEXITY_BOUNDS, accuracy_verdict, verdict_error
from trtinfer.stage_weights import save_graph


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "trtinfer", *map(str, args)], check=False, capture_output=True,
                          text=True, env=env)


@pytest.fixture(scope="module")
def optimized(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny Llama's optimized fp32 stage (``trtinfer optimize``)."""
    from trtinfer.export import export
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_stage

    work = tmp_path_factory.mktemp("verdict")
    exported = export(tiny_model_dir("llama"), work / "export")
    return optimize_stage(exported, work / "opt", PassConfig(max_seq_len=256)).path


@pytest.fixture(scope="module")
def broken(optimized, tmp_path_factory) -> Path:
    """An int8 quantize stage whose first MatMulNBits has its block scales x100 (re-recorded, so it reads as valid)."""
    stage = quantize_stage(optimized, tmp_path_factory.mktemp("q") / "int8", QuantConfig(precision="int8"),
                           progress=False)
    model = ir.load(str(stage.onnx_path))
    node = next(n for n in model.graph if n.op_type == "MatMulNBits")
    scales = node.inputs[2]
    scales.const_value = ir.tensor(scales.const_value.numpy() * np.float32(100), name=scales.name)
    side = stage.path / "side"
    side.mkdir()
    save_graph(model, side / ONNX_NAME)
    for f in side.iterdir():
        f.replace(stage.path / f.name)
    side.rmdir()
    info = {k: v for k, v in stage.info.items() if k not in ("files", "format")}
    write_stage(stage.path, info)
    return stage.path


def test_quantize_stage_keeps_the_fp32_scores(broken):
    stage = read_stage(broken)
    ref = np.load(stage.path / HELDOUT_NAME)
    assert len(ref["ids"]) == len(ref["logprobs"]) + 1 == len(ref["argmax"]) + 1 > 100
    assert np.isfinite(ref["logprobs"]).all() and (ref["logprobs"] < 0).all()


def test_the_fp32_scores_are_computed_once_per_fp32_stage(optimized, tmp_path, monkeypatch, caplog):
    """Every quantized graph of one fp32 stage is judged against the same fp32 scores, so they are computed once: the
    cache's ``scores`` entry of that stage serves an int8 then an int4 build of it and int8-static's fallback report
    (which reads them back from its own folder first); a saved file of other ids is not trusted, and without a usable
    cache they are computed in place."""
    import logging

    from trtinfer.quantization.accuracy import accuracy_report

    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))

    def scored() -> int:
        return sum("scoring the fp32 graph" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO, logger="trtinfer"):
        int8 = quantize_stage(optimized, tmp_path / "int8", QuantConfig(precision="int8"), progress=False)
        assert scored() == 1
        int4 = quantize_stage(optimized, tmp_path / "int4", QuantConfig(precision="int4", method="rtn"),
                              progress=False)
        assert scored() == 1
        assert len(list((tmp_path / "cache" / "scores").iterdir())) == 1
        folder = tmp_path / "scratch"
        folder.mkdir()
        for name in ("model.onnx", "model.onnx.data"):
            shutil.copyfile(int8.path / name, folder / name)
        fp32 = read_stage(optimized)
        first = accuracy_report(fp32, folder)
        second = accuracy_report(fp32, folder)
        with np.load(folder / HELDOUT_NAME) as z:
            np.savez(folder / HELDOUT_NAME, ids=z["ids"][::-1].copy(), logprobs=z["logprobs"], argmax=z["argmax"])
        third = accuracy_report(fp32, folder)
        assert scored() == 1
        (tmp_path / "not-a-folder").write_text("")
        monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "not-a-folder"))
        (folder / HELDOUT_NAME).unlink()
        fourth = accuracy_report(fp32, folder)
        assert scored() == 2
    drop = ("seconds",)
    assert all({k: v for k, v in first.items() if k not in drop} == {k: v for k, v in r.items() if k not in drop}
               for r in (second, third, fourth))
    assert first == {**int8.history["quantize"]["accuracy"], "seconds": first["seconds"]}
    with np.load(int8.path / HELDOUT_NAME) as a, np.load(int4.path / HELDOUT_NAME) as b:
        assert np.array_equal(a["logprobs"], b["logprobs"]) and np.array_equal(a["argmax"], b["argmax"])


def test_broken_scale_fails_the_build(broken, tmp_path):
    out = tmp_path / "engine"
    # random weights: the fp32 model is near-uniform on the text (perplexity above its 320-token vocabulary), so
    # top-1 agreement says nothing there; the broken graph's perplexity ratio (x0.77) is what fails it
    with pytest.raises(BuildError, match=r"the int8 engine misses its accuracy bound: on \d+ held-out tokens .* "
                                         r"\(x0\.\d+\).* outside x0.952..x1.05.* accept it with "
                                         r"--max-perplexity-ratio \d"):
        build(broken, out, BuildConfig(precision="int8"), progress=False)
    assert not out.exists()
    p = cli("build", broken, "-o", out, "--precision", "int8", "-q")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("trtinfer")]
    assert len(lines) == 1 and "misses its accuracy bound" in lines[0] and "perplexity" in lines[0], p.stderr
    assert not out.exists()


def test_explicit_bound_accepts_and_is_recorded(broken, tmp_path):
    out = build(broken, tmp_path / "engine", BuildConfig(precision="int8", max_perplexity_ratio=1e6), progress=False)
    acc = json.loads((out / "manifest.json").read_text())["accuracy_check"]
    assert acc["bound"] == 1e6 and acc["bound_set_by"] == "--max-perplexity-ratio" and acc["passed"]
    assert acc["top1_agreement"] < 0.25  # the broken scale really changed the model


def test_verdict_is_two_sided_and_floors_top1():
    acc = {"text": "builtin:gpl-3.0", "tokens": 1024, "perplexity": 20.0, "perplexity_fp32": 19.0, "top1_agreement": 0.9}
    assert accuracy_verdict({**acc, "ratio": 1.04}, "int8", None)["passed"]
    for ratio, top1 in ((1.06, 0.9), (0.94, 0.9), (1.0, 0.2), (math.inf, 0.9)):
        judged = accuracy_verdict({**acc, "ratio": ratio, "top1_agreement": top1}, "int8", None)
        assert not judged["passed"], (ratio, top1)
        line = verdict_error(judged, "int8")
        assert "\n" not in line and ("x1.05" in line or "25%" in line or "not finite" in line), line
    assert accuracy_verdict({**acc, "ratio": 1.3, "top1_agreement": 0.2}, "int4", 1.31)["passed"]
    # a model near-uniform on the text (fp32 perplexity >= a quarter of its vocabulary: random weights at real size)
    # is judged by the ratio alone; a confident one keeps the floor
    uniform = {**acc, "perplexity_fp32": 202041.5, "perplexity": 198874.1, "vocab_size": 128256}
    assert accuracy_verdict({**uniform, "ratio": 0.984, "top1_agreement": 0.092}, "int4", None)["passed"]
    assert not accuracy_verdict({**uniform, "ratio": 0.8, "top1_agreement": 0.092}, "int4", None)["passed"]
    assert not accuracy_verdict({**acc, "vocab_size": 128256, "ratio": 1.0, "top1_agreement": 0.2}, "int8",
                                None)["passed"]
    assert not accuracy_verdict({**acc, "ratio": 1.3}, "int4", None)["passed"]  # int4's default is x1.15
    assert accuracy_verdict({**acc, "ratio": 1.019}, "gguf", None)["passed"]


@pytest.mark.parametrize("precision", ["int8", "int8-static"])
def test_sound_build_passes_with_the_default_bound(optimized, tmp_path, precision):
    out = build(optimized, tmp_path / "engine", BuildConfig(precision=precision), progress=False)
    acc = json.loads((out / "manifest.json").read_text())["accuracy_check"]
    assert acc["passed"] and acc["bound"] == PERPLEXITY_BOUNDS[precision] and acc["bound_set_by"] == "default"
    assert acc["ratio"] <= PERPLEXITY_BOUNDS[precision] and acc["top1_agreement"] > 0.5 and acc["tokens"] > 100
    p = cli("inspect", out)
    assert p.returncode == 0 and f"bound x{PERPLEXITY_BOUNDS[precision]:g}: passed" in p.stdout, p.stdout


def test_bound_flag_is_checked():
    with pytest.raises(ConfigError, match="must be a number >= 1"):
        BuildConfig(precision="int4", max_perplexity_ratio=0.9)
    with pytest.raises(ConfigError, match="bounds quantized engines"):
        BuildConfig(precision="fp32", max_perplexity_ratio=1.2)
