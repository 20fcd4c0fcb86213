"""``trtinfer inspect DIR --target tensorrt`` on tiny stages and engines (subprocess, as a user runs it): the
tensorrt-target stage passes, ONNX Runtime graphs fail naming their com.microsoft nodes, and no weight is read."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "trtinfer", *map(str, args)], check=False, capture_output=True,
                          text=True, env=env)


def check(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return cli("inspect", path, "--target", "tensorrt", *flags)


def graph_nodes(path: Path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(path), load_external_data=False).graph.node)


@pytest.fixture(scope="module")
def stages(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny llama's export optimized for ``tensorrt`` and for ``onnxruntime-cpu``: {target: stage dir}."""
    from trtinfer.export import ExportConfig, export
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_stage

    root = tmp_path_factory.mktemp("inspect-trt")
    exp = export(tiny_model_dir("llama"), root / "exp", ExportConfig(validate=False))
    return {t: optimize_stage(exp, root / t, PassConfig(target=t, max_seq_len=64)).path
            for t in ("tensorrt", "onnxruntime-cpu")}


def test_tensorrt_stage_is_all_supported(stages) -> None:
    p = check(stages["tensorrt"])
    n = len(graph_nodes(stages["tensorrt"] / "model.onnx"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"TensorRT 10.15 parser: all {n} nodes supported"
    assert json.loads(check(stages["tensorrt"], "--json").stdout) == []


def test_onnxruntime_stage_fails_naming_its_contrib_nodes(stages) -> None:
    path = stages["onnxruntime-cpu"] / "model.onnx"
    contrib = {n.name: f"com.microsoft::{n.op_type}" for n in graph_nodes(path) if n.domain == "com.microsoft"}
    assert {"com.microsoft::GroupQueryAttention", "com.microsoft::SkipSimplifiedLayerNormalization"} <= set(contrib.values())
    p = check(stages["onnxruntime-cpu"])
    assert p.returncode == 1, p.stderr
    *lines, summary = p.stdout.strip().splitlines()
    listed = {ln.split()[0]: ln.split()[1] for ln in lines}
    assert {k: v for k, v in listed.items() if v.startswith("com.microsoft::")} == contrib
    assert all("ONNX Runtime contrib op" in ln for ln in lines if "com.microsoft::" in ln)
    assert listed.get(next(n.name for n in graph_nodes(path) if n.op_type == "SimplifiedLayerNormalization")) \
        == "SimplifiedLayerNormalization"  # ORT's, though in the default domain
    assert summary == f"TensorRT 10.15 parser: {len(listed)} of {len(graph_nodes(path))} nodes rejected"
    as_json = json.loads(check(stages["onnxruntime-cpu"], "--json").stdout)
    assert [(r["node"], r["op"]) for r in as_json] == [(ln.split()[0], ln.split()[1]) for ln in lines]
    assert all(r["reason"] for r in as_json)


def test_check_reads_no_weights(stages, tmp_path) -> None:
    """The graph alone (stage.json + model.onnx, no model.onnx.data) checks as the whole stage does."""
    for target, code in (("tensorrt", 0), ("onnxruntime-cpu", 1)):
        bare = tmp_path / target
        bare.mkdir()
        for name in ("stage.json", "model.onnx"):
            shutil.copyfile(stages[target] / name, bare / name)
        assert (stages[target] / "model.onnx.data").is_file() and not (bare / "model.onnx.data").exists()
        for path in (bare, bare / "model.onnx"):
            p = check(path)
            assert (p.returncode, p.stdout) == (code, check(stages[target]).stdout), p.stderr


def test_engine_directory_built_for_onnxruntime_fails(tiny_engine) -> None:
    p = check(tiny_engine("llama"))
    assert p.returncode == 1, p.stderr
    assert "com.microsoft::GroupQueryAttention" in p.stdout


def test_not_a_graph_is_one_line_exit_2(stages, tmp_path) -> None:
    for path, needle in ((tmp_path / "none", "does not exist"), (tmp_path, "is not a stage directory")):
        p = check(path)
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert p.stderr.strip().splitlines()[-1].startswith("trtinfer inspect: error:") and needle in p.stderr


def test_help_documents_the_exit_status() -> None:
    out = " ".join(cli("inspect", "--help").stdout.split())
    assert "0 when TensorRT's parser takes every node, 1 when it would reject some" in out
