"""A quantized engine stores its stage's weights once (a hard link to the cache's stage data), works without the
cache, and an engine whose bytes differ from the stage's keeps its own copy."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx
import pytest

from trtinfer.artifact import DATA_NAME, ONNX_NAME
from trtinfer.builder import BuildConfig, build
from trtinfer.builder.shared_weights import share_stage_weights
from trtinfer.quantization import QuantConfig
from trtinfer.runtime import load

PROMPT = [5, 17, 9, 42, 3, 11]


def _stage_data(cache: Path, engine: Path) -> Path:
    """The stage data file in ``cache`` that ``engine``'s data file is a link to."""
    ino = (engine / DATA_NAME).stat().st_ino
    found = [p for p in cache.rglob(DATA_NAME) if p.stat().st_ino == ino]
    assert len(found) == 1, found
    return found[0]


def _largest_offset(graph_path: Path) -> int:
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    spans = [{e.key: e.value for e in t.external_data} for t in graph.initializer
             if t.data_location == onnx.TensorProto.EXTERNAL]
    return int(max(spans, key=lambda s: int(s["length"])).get("offset", 0))


def _greedy(engine: Path) -> list[int]:
    (out,) = load(engine).generate(input_ids=[PROMPT], max_new_tokens=8, do_sample=False, ignore_eos=True)
    return list(out.token_ids)


@pytest.fixture
def linked_engine(tiny_model_dir, tmp_path, monkeypatch):
    """An int4 engine built with a cache of its own in ``tmp_path``; ``(engine, cache)``."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRTINFER_CACHE", str(cache))
    engine = build(tiny_model_dir("llama"), tmp_path / "engine", BuildConfig(precision="int4", quantization=QuantConfig(precision="int4", method="rtn")),
                   progress=False)
    return engine, cache


def test_a_quantized_engine_stores_its_stage_weights_once(linked_engine):
    engine, cache = linked_engine
    data = engine / DATA_NAME
    assert data.stat().st_nlink == 2
    stage = _stage_data(cache, engine)
    size = data.stat().st_size
    graph = onnx.load(str(engine / ONNX_NAME), load_external_data=False).graph
    spans = [{e.key: e.value for e in t.external_data} for t in graph.initializer
             if t.data_location == onnx.TensorProto.EXTERNAL]
    assert spans and all(s["location"] == DATA_NAME for s in spans)
    assert all(int(s["offset"]) + int(s["length"]) <= size for s in spans)
    assert sum(int(s["length"]) for s in spans) >= 0.99 * size  # the weights, not a file of something else
    before = _greedy(engine)
    shutil.rmtree(cache)  # the engine holds all it needs
    assert not stage.exists() and data.stat().st_nlink == 1
    assert _greedy(engine) == before


def test_an_engine_whose_bytes_differ_keeps_its_own_copy(linked_engine, tmp_path):
    engine, cache = linked_engine
    stage_data = _stage_data(cache, engine)
    ids = _greedy(engine)
    own = tmp_path / "own"
    shutil.copytree(engine, own)  # its own copy of the file, at the stage's offsets
    assert (own / DATA_NAME).stat().st_nlink == 1
    for name, change in (("changed", True), ("same", False)):
        stage = tmp_path / name
        stage.mkdir()
        shutil.copy(stage_data.parent / ONNX_NAME, stage / ONNX_NAME)
        shutil.copy(stage_data, stage / DATA_NAME)
        if change:  # one byte inside the largest tensor
            with open(stage / DATA_NAME, "r+b") as f:
                f.seek(_largest_offset(stage / ONNX_NAME))
                first = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([first[0] ^ 1]))
            assert share_stage_weights(own / ONNX_NAME, stage / ONNX_NAME) == 0
            assert (own / DATA_NAME).stat().st_nlink == 1
        else:
            assert share_stage_weights(own / ONNX_NAME, stage / ONNX_NAME) == (stage / DATA_NAME).stat().st_size
            assert (own / DATA_NAME).stat().st_ino == (stage / DATA_NAME).stat().st_ino
    assert _greedy(own) == ids
