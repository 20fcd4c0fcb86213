"""Fixtures of the live-server tests (``test_server.py``: uvicorn in a thread; ``test_ray.py``: Ray Serve)."""
from __future__ import annotations

from pathlib import Path

import pytest

import trtinfer


@pytest.fixture(scope="module")
def engine_dir(tiny_engine) -> Path:
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def ref(engine_dir):
    """The same engine loaded here: the answers' reference (``generate`` of each prompt alone)."""
    with trtinfer.load(engine_dir) as eng:
        yield eng
