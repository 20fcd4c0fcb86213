"""Encoder engines: the real all-MiniLM-L6-v2 against sentence-transformers, the embed CLI, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import trtinfer
from trtinfer.cli import main

SENTENCES = [
    "The cat sits on the mat.",
    "A man is playing a guitar on stage in front of a large crowd at the summer festival.",
    "ONNX Runtime executes machine learning models on many kinds of hardware.",
    "Paris is the capital and most populous city of France.",
    "How do I reset my password?",
    "Quantum computers use qubits, which can be in superpositions of states, to solve certain problems faster.",
    "ok",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
]


@pytest.fixture(scope="session")
def minilm_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trtinfer.builder import build

    return build("all-minilm-l6-v2", tmp_path_factory.mktemp("minilm") / "engine", progress=False)


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(minilm_engine: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from trtinfer import load
    from trtinfer.artifact import read_manifest
    from trtinfer.export.sources import resolve_model

    ref = SentenceTransformer(str(resolve_model("all-minilm-l6-v2").path), device="cpu").encode(SENTENCES)
    with load(minilm_engine) as eng:
        got = eng.embed(SENTENCES, batch_size=8)  # one padded batch of very different lengths
    assert got.shape == ref.shape == (len(SENTENCES), 384)
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the model's Normalize module
    fused = read_manifest(minilm_engine).raw["fused_ops"]
    assert fused["attention"]["count"] == fused["attention"]["expected"] == 6
    assert fused["norm"]["count"] >= 13


@pytest.mark.slow
def test_embed_cli(minilm_engine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed", str(minilm_engine), "--text", "hello world", "--text", "good morning", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["text"] for r in rows] == ["hello world", "good morning"]
    a, b = (np.array(r["embedding"]) for r in rows)
    assert len(a) == 384 and 0.0 < float(a @ b) < 0.99


@pytest.mark.slow
def test_embed_bad_input(minilm_engine: Path, tiny_engine, capsys: pytest.CaptureFixture[str]) -> None:
    from trtinfer.errors import InputError
    from trtinfer.runtime.encoder import EncoderEngine

    eng = EncoderEngine(minilm_engine)
    with pytest.raises(InputError, match="non-empty list"):
        eng.embed([])
    with pytest.raises(InputError, match=r"embed\(\) takes strings; items \[1\] are not"):
        eng.embed(["fine", 3])  # type: ignore[list-item]
    decoder = tiny_engine("llama")
    capsys.readouterr()  # drop the fixture's build progress
    assert main(["embed", str(decoder), "--text", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decoder engine" in err[0]


@pytest.mark.slow
def test_generate_refuses_an_encoder_engine(minilm_engine: Path, tiny_engine, capsys: pytest.CaptureFixture[str]) -> None:
    """generate loaded the encoder, then failed with an internal AttributeError."""
    capsys.readouterr()
    assert main(["generate", str(minilm_engine), "-p", "hi", "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an encoder engine" in err[0] and "trtinfer embed" in err[0]
    decoder = tiny_engine("llama")
    capsys.readouterr()
    assert main(["generate", str(decoder), "-p", "hi", "-n", "2", "--assistant", str(minilm_engine)]) == 2
    assert "(--assistant) is an encoder engine" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "says"), [
    (["--precision", "int8"], "precision ('int8') applies to decoder builds"),
    (["--precision", "fp16"], "precision ('fp16') applies to decoder builds"),
    (["--disable-pass", "rotary"], "disable passes"),
])
def test_encoder_build_refuses_decoder_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                                                says: str) -> None:
    """An encoder build ignored --precision, --prefill and --disable-pass: exit 0 with an fp32 engine whose manifest
    recorded the precision asked."""
    assert main(["build", "all-minilm-l6-v2", "-o", str(tmp_path / "e"), *flags]) != 0
    assert says in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_encoder_provider_and_close(minilm_engine: Path) -> None:
    import onnxruntime as ort

    from trtinfer.errors import BackendUnavailableError, EngineLoadError

    if "CUDAExecutionProvider" not in ort.get_available_providers():  # the provider is honoured, not ignored
        with pytest.raises(BackendUnavailableError, match="provider 'cuda' needs onnxruntime-gpu"):
            trtinfer.load(minilm_engine, provider="cuda")
    eng = trtinfer.load(minilm_engine)
    assert eng.embed(["hello"]).shape[0] == 1
    eng.close()
    with pytest.raises(EngineLoadError, match="is closed"):
        eng.embed(["hello"])
