"""Export + validation of every registered architecture on tiny random configs."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from tiny_models import ARCHS

from trtinfer.errors import ConfigError, ModelSourceError, UnsupportedArchitectureError
from trtinfer.export import ExportConfig, export, supported_model_types
from trtinfer.stage_weights import checkpoint_inputs, graph_weight_bytes, materialized_file


@pytest.mark.parametrize("arch", ARCHS)
def test_export_validates_against_eager(arch, tiny_model_dir, tmp_path):
    res = export(tiny_model_dir(arch), tmp_path / "out")
    v = res.validation
    assert v["passed"] and v["top1_agree"]
    assert v["decode_logits_max_abs_diff"] < 1e-4
    assert v["present_max_abs_diff"] < 1e-4
    model = onnx.load(str(res.onnx_path), load_external_data=False)
    refs = checkpoint_inputs(model)  # the weights, read from the checkpoint: not inputs to feed
    names_in = [i.name for i in model.graph.input if i.name not in refs]
    n = res.info["geometry"]["num_layers"]
    assert refs and set(refs) <= set(res.info["weights"])
    assert not (set(refs) & {i.name for i in model.graph.initializer})
    assert names_in[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert names_in[3:] == [f"past_key_values.{i}.{k}" for i in range(n) for k in ("key", "value")]
    assert [o.name for o in model.graph.output][1:] == [f"present.{i}.{k}" for i in range(n) for k in ("key", "value")]
    dims = [d.dim_param for d in model.graph.input[3].type.tensor_type.shape.dim]
    assert dims[0] == "batch" and dims[2] == "past_sequence"
    stage = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert stage["stage"] == "export" and stage["architecture"] == res.info["architecture"]
    assert set(stage["files"]) >= {"model.onnx", "tokenizer.json", "reference.npz"}
    # no copy of the weights: only what a recipe computes (Gemma's 1 + w norm gains) is written
    data = tmp_path / "out" / "model.onnx.data"
    assert (data.stat().st_size if data.is_file() else 0) < 0.05 * graph_weight_bytes(res.onnx_path)


def test_dynamic_shapes_other_than_traced(tiny_model_dir, tmp_path):
    """Batch 3, sequence 1..11 and past 0..20 all run and give finite logits."""
    res = export(tiny_model_dir("llama"), tmp_path / "out")
    with materialized_file(res.onnx_path) as whole:
        sess = ort.InferenceSession(str(whole), providers=["CPUExecutionProvider"])
    g = res.info["geometry"]
    for b, s, p in [(1, 1, 0), (3, 11, 0), (3, 1, 20), (4, 5, 7)]:
        feed = {"input_ids": np.ones((b, s), np.int64), "attention_mask": np.ones((b, p + s), np.int64),
                "position_ids": np.tile(np.arange(p, p + s), (b, 1))}
        for i in range(g["num_layers"]):
            for k in ("key", "value"):
                feed[f"past_key_values.{i}.{k}"] = np.random.rand(b, g["num_kv_heads"], p, g["head_dim"]).astype("f4")
        out = sess.run(None, feed)
        assert out[0].shape == (b, 1, g["vocab_size"])
        assert out[1].shape == (b, g["num_kv_heads"], p + s, g["head_dim"])
        assert np.isfinite(out[0]).all()


def test_all_logits_mode(tiny_model_dir, tmp_path):
    res = export(tiny_model_dir("qwen2"), tmp_path / "out", ExportConfig(logits="all"))
    assert res.info["io"]["outputs"][0]["shape"][1] == "sequence"
    assert res.validation["passed"]


def test_unknown_architecture_is_refused_listing_supported(tmp_path):
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "m")
    with pytest.raises(UnsupportedArchitectureError) as e:
        export(tmp_path / "m", tmp_path / "out")
    assert "bloom" in str(e.value) and "llama" in str(e.value) and "gemma3_text" in str(e.value)
    assert not (tmp_path / "out").exists()
    assert torch  # imported for the model save above


def test_a_type_transformers_does_not_know_is_one_line(tmp_path):
    """Not transformers' several paragraphs about upgrading it: our list of what exports."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "foo", "architectures": ["FooForCausalLM"]}))
    with pytest.raises(UnsupportedArchitectureError, match=r"^architecture 'foo' is not supported for export; "
                                                           r"supported: .*llama") as e:
        export(tmp_path / "m", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_supported_types_cover_issue_list():
    assert {"llama", "gemma3_text", "qwen2", "qwen3", "mistral", "phi3", "gpt2"} <= set(supported_model_types())


@pytest.mark.parametrize("kw", [{"logits": "some"}, {"opset": 9}, {"atol": 0}])
def test_bad_export_config(kw):
    with pytest.raises(ConfigError):
        ExportConfig(**kw)


def test_bad_sources(tmp_path):
    from trtinfer.export import resolve_model

    with pytest.raises(ModelSourceError, match="not found"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="config.json"):
        resolve_model(tmp_path / "empty")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_model(tmp_path / "x.txt")
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ModelSourceError, match="magic"):
        resolve_model(tmp_path / "bad.gguf")


def test_validation_skipped_where_eager_does_not_fit(tiny_model_dir, tmp_path, monkeypatch):
    """With less memory available than twice an fp32 copy of the model, the export is not compared with eager and
    computes no engine-check reference (neither fits), says so in its record and the engine's manifest, and the
    engine still builds and runs."""
    from trtinfer.builder import build
    from trtinfer.cli.summary import validation_text
    from trtinfer.runtime import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 2**16)  # 64 KiB: the tiny model's fp32 copy is larger
    stage = export(tiny_model_dir("llama"), tmp_path / "x")
    assert stage.validation is None
    why = stage.history["export"]["validation_skipped"]
    assert "eager does not fit" in why and "GiB available" in why
    no_ref = stage.history["export"]["reference_skipped"]
    assert "the fp32 graph does not fit" in no_ref and stage.reference_path is None
    monkeypatch.undo()
    engine = build(stage.path, tmp_path / "engine", progress=False)
    m = json.loads((engine / "manifest.json").read_text())
    assert m["export"]["validation"] is None and m["export"]["validation_skipped"] == why
    assert m["export"]["reference_skipped"] == no_ref and "engine_check" not in m
    from trtinfer.runtime import load

    assert len(load(engine).generate(input_ids=[[1, 2, 3]], max_new_tokens=3, ignore_eos=True)[0].token_ids) == 3
    assert validation_text(m["export"]["validation"], m["export"]["validation_skipped"]).startswith(
        "not validated against eager (eager does not fit")
    # each stage records the process's peak memory so far
    assert all(rec["peak_rss_mib"] > 50 for rec in m["stages"].values()), m["stages"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_eager_reference_may_keep_the_first_tokens_only(arch, tiny_model_dir, tmp_path, monkeypatch):
    """Past VALIDATION_VOCAB tokens the eager model keeps the first ones (embedding and head rows); prompts use them
    and their logits are compared, and the record says how many (here in-process: torch is loaded by the suite)."""
    from trtinfer.export import onnx_export

    vocab = json.loads((tiny_model_dir(arch) / "config.json").read_text())["vocab_size"]
    monkeypatch.setattr(onnx_export, "VALIDATION_VOCAB", 64)
    v = export(tiny_model_dir(arch), tmp_path / "cut").validation
    assert v["passed"] and v["top1_agree"] and v["present_max_abs_diff"] < 1e-4
    assert (v["vocab_compared"], v["vocab_size"]) == (64, vocab) and vocab > 64


def test_the_eager_reference_keeps_every_token_a_special_id_needs():
    from types import SimpleNamespace

    from trtinfer.export.onnx_export import VALIDATION_VOCAB, validation_vocab

    big = VALIDATION_VOCAB * 4
    assert validation_vocab(SimpleNamespace(vocab_size=big, pad_token_id=0, eos_token_id=[1, 106])) == VALIDATION_VOCAB
    assert validation_vocab(SimpleNamespace(vocab_size=big, pad_token_id=big - 1)) == big  # a padding row past the cut
    assert validation_vocab(SimpleNamespace(vocab_size=VALIDATION_VOCAB - 5)) == VALIDATION_VOCAB - 5


def test_a_broken_chat_template_is_a_warning_at_export(tiny_model_dir, tmp_path, caplog):
    """A chat template that does not parse passed the export and the build silently and failed at the first chat
    request; the export now says so (the model still exports: completions work without a template)."""
    import logging
    import shutil

    src = shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    caplog.set_level(logging.WARNING, logger="trtinfer")
    stage = export(src, tmp_path / "exp", ExportConfig(validate=False))
    assert stage.path.is_dir()
    said = [r.getMessage() for r in caplog.records if "chat template is not usable" in r.getMessage()]
    assert len(said) == 1 and "does not parse" in said[0]
