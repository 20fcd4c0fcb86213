"""Shared fixtures: tiny random models of every architecture and engines built from them; real-model engines."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(arch)`` -> folder of a tiny random model (built once per session)."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(arch, tmp_path_factory.mktemp(f"src-{arch}"))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):
    """``tiny_engine(arch, **build_config)`` -> engine directory (built once per arch and config)."""
    from trtinfer.builder import BuildConfig, build

    made: dict[tuple, Path] = {}

    def get(arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"engine-{arch}") / "engine"
            made[key] = build(tiny_model_dir(arch), out, BuildConfig(**kw), progress=False)
        return made[key]

    return get


def pytest_collection_modifyitems(config, items):
    """Mark GPU tests skipped with a reason when no CUDA provider is present."""
    try:
        import onnxruntime as ort

        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs onnxruntime-gpu with CUDAExecutionProvider and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)


__all__ = ["ARCHS"]
