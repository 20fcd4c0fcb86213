"""`trtinfer build --backend tensorrt` where TensorRT or a GPU is missing: one line, exit 3, no output, no work done.

This machine has no TensorRT (a ``tensorrt-stubs`` install leaves an importable ``tensorrt`` folder of type stubs,
which must count as missing too) and no GPU. Where both exist the check passes and this test skips.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtinfer.errors import BackendUnavailableError


def _tensorrt_runs() -> bool:
    from trtinfer.builder.trt_backend import require_tensorrt

    try:
        require_tensorrt()
    except BackendUnavailableError:
        return False
    return True


def test_build_without_tensorrt_stops_at_once(tiny_model_dir, tmp_path: Path):
    if _tensorrt_runs():
        pytest.skip("TensorRT and a GPU are present: the build would run")
    out = tmp_path / "engine"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TRTINFER_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "trtinfer", "build", str(tiny_model_dir("llama")), "-o", str(out),
                        "--backend", "tensorrt", "--precision", "fp16"], capture_output=True, text=True, env=env,
                       check=False)
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trtinfer build: error: --backend tensorrt needs TensorRT >= 10.15")
    assert "install 'trtinfer[tensorrt]'" in lines[0] and "--backend onnxruntime" in lines[0]
    assert not out.exists() and not list(tmp_path.glob("engine*"))  # no output, not even a temp folder
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.onnx"))  # nothing exported


def test_python_api_raises_the_same(tiny_model_dir, tmp_path: Path):
    if _tensorrt_runs():
        pytest.skip("TensorRT and a GPU are present")
    from trtinfer.builder import BuildConfig, build

    with pytest.raises(BackendUnavailableError, match="TensorRT >= 10.15"):
        build(tiny_model_dir("llama"), tmp_path / "e", BuildConfig(backend="tensorrt"), progress=False)
    assert not (tmp_path / "e").exists()


def test_loading_a_tensorrt_engine_without_tensorrt_is_one_line(tiny_engine, tmp_path: Path):
    """An engine directory whose manifest names the tensorrt backend, on a machine without TensorRT."""
    if _tensorrt_runs():
        pytest.skip("TensorRT and a GPU are present")
    import json
    import shutil

    eng = tmp_path / "eng"
    shutil.copytree(tiny_engine("llama"), eng)
    manifest = json.loads((eng / "manifest.json").read_text())
    manifest["backend"] = "tensorrt"
    (eng / "manifest.json").write_text(json.dumps(manifest))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-m", "trtinfer", "generate", str(eng), "-p", "Hello", "-n", "2"],
                       capture_output=True, text=True, env=env, check=False)
    assert p.returncode == 3 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(
        "trtinfer generate: error: this TensorRT engine needs TensorRT >= 10.15")
