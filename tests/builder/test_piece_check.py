"""A model whose fp32 graph does not fit is checked on a reduced-depth build of itself (same checkpoint tensors)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trtinfer.builder import BuildConfig, build
from trtinfer.errors import BuildError
from trtinfer.export import ExportConfig, export
from trtinfer.stage_weights import graph_weight_bytes


@pytest.fixture
def only_the_slice_fits(tiny_model_dir, tmp_path, monkeypatch):
    """Memory that holds the tiny Llama cut to one layer in fp32 but not the whole (two-layer) model."""
    from trtinfer.runtime import memory

    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    src = tiny_model_dir("llama")
    whole = graph_weight_bytes(export(src, tmp_path / "whole", ExportConfig(validate=False)).onnx_path)
    cut = graph_weight_bytes(export(src, tmp_path / "cut", ExportConfig(validate=False, layers=1)).onnx_path)
    assert cut < whole
    monkeypatch.setattr(memory, "fits_in_memory", lambda n: n <= (whole + cut) // 2)
    return src


def test_engine_of_a_model_too_large_for_fp32_is_checked_on_its_first_layers(only_the_slice_fits, tmp_path, capsys,
                                                                              monkeypatch):
    from trtinfer.builder import piece_check
    from trtinfer.cli import main

    monkeypatch.setattr(piece_check, "VOCAB", 100)  # tiny Llama has 320 tokens: the cut keeps the first 100

    assert main(["build", str(only_the_slice_fits), "-o", str(tmp_path / "engine"), "--precision", "int8", "-q"]) == 0
    out = capsys.readouterr().out
    assert "checked on a reduced model, its first 1 of 2 layers and 100 of 320 tokens (same weights; the whole model " \
        "does not fit in fp32)" in out
    engine = tmp_path / "engine"
    m = json.loads((engine / "manifest.json").read_text())
    assert m["export"]["validation"] is None and "engine_check" not in m  # the whole model: neither fits
    assert "does not fit" in m["export"]["reference_skipped"]
    r = m["reduced_depth_check"]
    assert r["layers"] == 1 and r["vocab"] == 100 and "first 1 of 2 decoder layers and the first 100 of 320" in r["scope"]
    assert r["export_validation"]["passed"] and r["engine_check"]["passed"]  # eager, engine, held-out accuracy ran
    assert r["accuracy_check"]["passed"] and r["accuracy_check"]["tokens"] > 100
    acc = m["accuracy_check"]  # the whole model's held-out accuracy: its quantize-stage graph, scored in pieces
    assert acc["scored"] == "quantize-stage graph" and acc["passed"] and acc["bound"] == 1.05
    assert acc["perplexity"] == m["quantization"]["accuracy"]["perplexity"]
    assert "accuracy of the quantize-stage graph (the engine is not loaded beside the build) on" in out
    assert not list(tmp_path.glob(".reduced-depth-*"))  # its engine and stages were removed
    assert m["geometry"]["num_layers"] == 2  # the engine itself is the whole model


def test_a_failing_reduced_depth_check_fails_the_build(only_the_slice_fits, tmp_path):
    """A reduced-depth engine that misses its accuracy bound fails the build: nothing is written."""
    with pytest.raises(BuildError, match=r"the reduced-depth check \(1 of 2 layers\) failed: .*perplexity"):
        build(only_the_slice_fits, tmp_path / "engine", BuildConfig(precision="int8", max_perplexity_ratio=1.0000001),
              progress=False)
    assert not (tmp_path / "engine").exists()


def test_export_layers_and_vocab_cut_the_model(tiny_model_dir, tmp_path):
    """A cut export reads the leading layers and rows of the same checkpoint tensors, and validates against an eager
    model loaded from those same rows."""
    import onnx
    from safetensors.numpy import load_file

    from trtinfer.stage_weights import load_graph

    src = tiny_model_dir("gemma3")  # 3 layers (sliding, sliding, full), 320 tokens, tied embeddings
    stage = export(src, tmp_path / "x", ExportConfig(layers=2, vocab=100))
    assert stage.geometry["num_layers"] == 2 and stage.geometry["vocab_size"] == 100 and stage.validation["passed"]
    assert not any("layers.2." in w["tensor"] for w in stage.info["weights"].values())
    model = load_graph(stage.onnx_path)
    table = model.graph.initializers["model.model.embed_tokens.weight"].const_value.numpy()
    full = load_file(str(src / "model.safetensors"))["model.embed_tokens.weight"].astype("float32")
    assert table.shape == (100, full.shape[1]) and (table == full[:100]).all()
    assert onnx.load(str(stage.onnx_path), load_external_data=False).graph.output[0].type.tensor_type.shape.dim[2] \
        .dim_value in (0, 100)
    p = subprocess.run([sys.executable, "-c", "from trtinfer.export import ExportConfig; ExportConfig(layers=0)"],
                       capture_output=True, text=True, check=False)
    assert "layers must be >= 1" in p.stderr


def test_a_padding_token_past_the_cut_is_dropped_from_the_reduced_model(tiny_model_dir, tmp_path):
    """A GGUF's converted config names its padding token (Qwen3: 151643, past the check's first 8192 rows): the cut
    model has none, where the eager reference once failed on it ("Padding_idx must be within num_embeddings")."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("llama"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "pad_token_id": 300}))  # of 320
    stage = export(src, tmp_path / "x", ExportConfig(layers=1, vocab=100))
    assert stage.geometry["vocab_size"] == 100 and stage.validation["passed"]


def test_the_reduced_depth_check_can_be_turned_off(only_the_slice_fits, tmp_path):
    engine = build(only_the_slice_fits, tmp_path / "engine", BuildConfig(precision="int8", reduced_depth_check=False),
                   progress=False)
    m = json.loads((engine / "manifest.json").read_text())
    assert "reduced_depth_check" not in m and "engine_check" not in m and m["export"]["reference_skipped"]
    assert m["build_config"]["reduced_depth_check"] is False
