"""Build a tiny random Llama engine at argv[1] (for .ci/light-install; runs in the main environment, which has the
export stack)."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_models import make_tiny_model

from trtinfer.builder import build

with tempfile.TemporaryDirectory() as src:
    build(make_tiny_model("llama", Path(src)), sys.argv[1], progress=False)
