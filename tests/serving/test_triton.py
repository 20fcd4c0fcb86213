"""``trtinfer triton``: model repositories for a tiny decoder and a tiny encoder engine, every config.pbtxt parsed
with tritonclient's ``model_config_pb2``; the request logic of the generated model.py against the real engine.

The Triton server is not installable here, so nothing is served: the repository is generated and checked.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="needs tritonclient (pip install 'trtinfer[triton]')")

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import trtinfer
from trtinfer.cli import main
from trtinfer.errors import BackendUnavailableError, ConfigError, InputError
from trtinfer.runtime.scheduler import Scheduler
from trtinfer.serving.config import ServeConfig
from trtinfer.serving.triton import (
    INPUT_NAMES,
    TritonConfig,
    parse_request,
    response_texts,
    submit,
    write_repository,
)

PROMPT = "The history of the city"


def _config(model_dir: Path) -> Any:
    """The model's config.pbtxt parsed into a ModelConfig (fails on any field Triton does not know)."""
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def _make_tiny_bert(out: Path) -> Path:
    """A tiny random BERT with a WordPiece tokenizer trained on the tiny models' corpus."""
    from tiny_models import CORPUS
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=special,
                                                              show_progress=False))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                      sep_token="[SEP]", mask_token="[MASK]").save_pretrained(out)
    # vocab 2048: the build's fused-vs-unfused check feeds ids up to 2000
    cfg = BertConfig(vocab_size=2048, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def decoder(tiny_engine) -> Path:
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trtinfer.builder import BuildConfig, build

    src = _make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))
    return build(src, tmp_path_factory.mktemp("bert-engine") / "engine", BuildConfig(max_batch_size=4),
                 progress=False)


@pytest.fixture(scope="module")
def engine(decoder: Path):
    with trtinfer.load(decoder) as eng:
        yield eng


# --- the repository ------------------------------------------------------------------------------------------
def test_decoder_repository(decoder: Path, tmp_path: Path) -> None:
    model = write_repository(decoder, tmp_path / "repo", TritonConfig(model_name="tiny"))
    assert model == tmp_path / "repo" / "tiny"
    cfg = _config(model)
    assert cfg.name == "tiny" and cfg.backend == "python" and cfg.platform == ""
    assert cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 0
    inputs = {i.name: i for i in cfg.input}
    assert tuple(inputs) == INPUT_NAMES
    assert inputs["text_input"].data_type == model_config_pb2.TYPE_STRING and not inputs["text_input"].optional
    assert all(i.optional for n, i in inputs.items() if n != "text_input")
    assert inputs["max_tokens"].data_type == model_config_pb2.TYPE_INT32
    assert inputs["temperature"].data_type == model_config_pb2.TYPE_FP32
    assert inputs["random_seed"].data_type == model_config_pb2.TYPE_UINT64
    assert list(inputs["stop_words"].dims) == [-1]
    assert [(o.name, o.data_type, list(o.dims)) for o in cfg.output] == [("text_output", model_config_pb2.TYPE_STRING,
                                                                          [-1])]
    assert [(g.kind, g.count) for g in cfg.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)]
    assert cfg.parameters["provider"].string_value == "cpu"
    # the engine is copied (not linked) and loads from there; model.py is valid Python
    copied = model / "1" / "engine"
    assert copied.is_dir() and not copied.is_symlink()
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in decoder.iterdir())
    with trtinfer.load(copied) as eng:
        assert eng.generate([PROMPT], max_new_tokens=3)[0].token_ids
    source = (model / "1" / "model.py").read_text()
    compile(source, "model.py", "exec")
    assert "TRITONSERVER_RESPONSE_COMPLETE_FINAL" in source and "get_response_sender" in source


def test_encoder_repository(encoder: Path, tmp_path: Path) -> None:
    manifest = json.loads((encoder / "manifest.json").read_text())
    model = write_repository(encoder, tmp_path / "repo", TritonConfig(max_queue_delay_us=500, instances=2))
    cfg = _config(model)
    assert cfg.name == "engine" and cfg.platform == "onnxruntime_onnx" and cfg.backend == ""
    assert cfg.max_batch_size == manifest["limits"]["max_batch_size"] == 4
    assert cfg.HasField("dynamic_batching") and cfg.dynamic_batching.max_queue_delay_microseconds == 500
    assert not cfg.model_transaction_policy.decoupled
    assert {i.name: (i.data_type, list(i.dims)) for i in cfg.input} == {
        n: (model_config_pb2.TYPE_INT64, [-1]) for n in ("input_ids", "attention_mask", "token_type_ids")}
    assert [(o.name, o.data_type, list(o.dims)) for o in cfg.output] == [
        ("last_hidden_state", model_config_pb2.TYPE_FP32, [-1, 32])]  # batch axis left out: Triton adds it
    assert [(g.kind, g.count) for g in cfg.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 2)]
    assert cfg.default_model_filename == "model.onnx"
    # the version folder's graph (external data beside it) runs with the dims config.pbtxt declares
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[2, 10, 11, 3], [2, 12, 3, 0]], dtype=np.int64)
    out = sess.run(None, {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64),
                          "token_type_ids": np.zeros_like(ids)})[0]
    assert out.shape == (2, 4, 32)


def test_tensorrt_encoder_is_a_plan(encoder: Path, tmp_path: Path) -> None:
    """A TensorRT encoder engine (none is built today; the manifest form is) becomes a tensorrt_plan model."""
    eng = tmp_path / "trt-encoder"
    shutil.copytree(encoder, eng)
    manifest = json.loads((eng / "manifest.json").read_text())
    manifest.update(backend="tensorrt", files={"encoder": "encoder.plan"})
    (eng / "manifest.json").write_text(json.dumps(manifest))
    (eng / "encoder.plan").write_bytes(b"plan")
    model = write_repository(eng, tmp_path / "repo")
    cfg = _config(model)
    assert cfg.platform == "tensorrt_plan" and cfg.default_model_filename == "model.plan"
    assert cfg.HasField("dynamic_batching") and cfg.max_batch_size == 4
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (model / "1" / "model.plan").read_bytes() == b"plan"


def test_tensorrt_decoder_stays_python(decoder: Path, tmp_path: Path) -> None:
    """TensorRT decoder engines run in the Python backend too (the trtinfer runtime drives TensorRT), on a GPU."""
    eng = tmp_path / "trt-decoder"
    shutil.copytree(decoder, eng)
    manifest = json.loads((eng / "manifest.json").read_text())
    manifest["backend"] = "tensorrt"
    (eng / "manifest.json").write_text(json.dumps(manifest))
    cfg = _config(write_repository(eng, tmp_path / "repo", TritonConfig(link=True)))
    assert cfg.backend == "python" and cfg.model_transaction_policy.decoupled
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    assert (tmp_path / "repo" / "trt-decoder" / "1" / "engine").resolve() == eng.resolve()


def test_cli(decoder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    assert main(["triton", str(decoder), "-o", str(repo), "--name", "llm", "--link", "--version", "3"]) == 0
    assert "tritonserver --model-repository" in capsys.readouterr().out
    version = repo / "llm" / "3"
    assert (version / "engine").is_symlink() and (version / "engine").resolve() == decoder.resolve()
    assert _config(repo / "llm").name == "llm"
    # an existing repository is refused without --force, in one line, and left as it was
    assert main(["triton", str(decoder), "-o", str(repo), "--name", "other"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--force" in err[0]
    assert sorted(p.name for p in repo.iterdir()) == ["llm"]
    assert main(["triton", str(decoder), "-o", str(repo), "--name", "other", "--force"]) == 0
    assert sorted(p.name for p in repo.iterdir()) == ["other"]
    assert not (repo / "other" / "1" / "engine").is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".repo")]  # no temp folders left behind
    # bad flags and bad engines: one line, exit 2
    assert main(["triton", str(decoder), "-o", str(tmp_path / "r2"), "--instances", "0"]) == 2
    assert "--instances must be an integer >= 1" in capsys.readouterr().err
    assert main(["triton", str(decoder), "-o", str(tmp_path / "r3"), "--name", "a/b"]) == 2
    assert "--name must be" in capsys.readouterr().err
    assert main(["triton", str(tmp_path / "nope"), "-o", str(tmp_path / "r4")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r4").exists()
    # a name that is a path (.., .) wrote the model beside -o; an output inside the engine copied the engine into
    # itself without end; the engine as -o with --force replaced it
    for name in ("..", "."):
        assert main(["triton", str(decoder), "-o", str(tmp_path / "r5"), "--name", name]) == 2
        assert "not only dots" in capsys.readouterr().err
    before = sorted(p.name for p in decoder.iterdir())
    for out, how in ((decoder / "repo", "is inside"), (decoder, "is")):
        assert main(["triton", str(decoder), "-o", str(out), "--force"]) == 2
        assert f"the output {out} {how} the input" in capsys.readouterr().err
    assert sorted(p.name for p in decoder.iterdir()) == before and not (tmp_path / "r5").exists()


def test_missing_tritonclient(decoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    for name in [m for m in sys.modules if m == "tritonclient" or m.startswith("tritonclient.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tritonclient", None)  # import tritonclient -> ImportError
    with pytest.raises(BackendUnavailableError, match=r'pip install "trtinfer\[triton\]"'):
        write_repository(decoder, tmp_path / "repo")
    assert main(["triton", str(decoder), "-o", str(tmp_path / "repo")]) == 2
    assert capsys.readouterr().err.strip() == "trtinfer triton needs tritonclient: pip install 'trtinfer[triton]'"
    assert not (tmp_path / "repo").exists()


# --- the request logic model.py runs -------------------------------------------------------------------------
def _s(*texts: str) -> np.ndarray:
    return np.array([t.encode() for t in texts], dtype=np.object_)


def test_parse_request(engine) -> None:
    defaults = engine.generation_defaults
    req = parse_request({"text_input": _s("hi")}, defaults)
    # the engine's defaults, without transformers' own top_k=50 (the tiny model's file sets no top_k)
    assert req.prompt == "hi" and req.config == dataclasses.replace(defaults, top_k=0) and req.stream
    req = parse_request({"text_input": _s("hi"), "max_tokens": np.array([7], np.int32),
                         "temperature": np.array([0.5], np.float32), "top_p": np.array([0.9], np.float32),
                         "top_k": np.array([-1], np.int32), "random_seed": np.array([3], np.uint64),
                         "stop_words": _s("\n", "."), "stream": np.array([False])}, defaults)
    c = req.config
    assert (c.max_new_tokens, c.do_sample, c.top_k, c.seed, c.stop) == (7, True, 0, 3, ("\n", "."))
    assert c.temperature == pytest.approx(0.5) and c.top_p == pytest.approx(0.9) and not req.stream
    # vLLM's sampling_parameters, overridden by single tensors; temperature 0 is greedy
    params = json.dumps({"temperature": 0, "max_tokens": 5, "seed": 1, "stop": "x", "ignore_eos": True})
    req = parse_request({"text_input": _s("hi"), "sampling_parameters": _s(params),
                         "max_tokens": np.array([9], np.int32)}, defaults)
    c = req.config
    assert (c.do_sample, c.max_new_tokens, c.seed, c.stop, c.ignore_eos) == (False, 9, 1, ("x",), True)
    with pytest.raises(InputError, match="text_input is required"):
        parse_request({"max_tokens": np.array([1], np.int32)})
    with pytest.raises(InputError, match=r"unknown input\(s\) \['prompt'\]"):
        parse_request({"text_input": _s("hi"), "prompt": _s("x")})
    with pytest.raises(InputError, match="sampling_parameters should be a JSON object"):
        parse_request({"text_input": _s("hi"), "sampling_parameters": _s("{nope")})
    with pytest.raises(InputError, match=r"unknown sampling_parameters \['best_of'\]"):
        parse_request({"text_input": _s("hi"), "sampling_parameters": _s('{"best_of": 2}')})
    with pytest.raises(InputError, match="should hold one value, found 2"):
        parse_request({"text_input": _s("a", "b")})
    with pytest.raises(ConfigError, match="max_new_tokens"):
        parse_request({"text_input": _s("hi"), "max_tokens": np.array([-1], np.int32)})


@pytest.mark.parametrize(("inputs", "says"), [
    ({"temperature": np.array([np.nan], np.float32)}, "temperature must be a finite number >= 0"),
    ({"temperature": np.array([-1.0], np.float32)}, "temperature must be a finite number >= 0"),
    ({"sampling_parameters": _s('{"temperature": "0.5"}')}, "temperature must be a finite number >= 0"),
    ({"sampling_parameters": _s('{"temperature": true}')}, "temperature must be a finite number >= 0"),
    ({"text_input": np.array([b"hi \xff"], dtype=np.object_)}, r"text_input is not UTF-8 text \(byte 0xff at 3\)"),
    ({"stop_words": np.array([b"\xc3"], dtype=np.object_)}, "stop_words is not UTF-8 text"),
])
def test_parse_request_refuses_bad_values(engine, inputs, says) -> None:
    """NaN or -1 passed as greedy, a string or null temperature was a TypeError, undecodable bytes a bare
    UnicodeDecodeError."""
    with pytest.raises(InputError, match=says):
        parse_request({"text_input": _s("hi"), **inputs}, engine.generation_defaults)


@pytest.mark.parametrize(("params", "says"), [
    ('{"top_k": -1.0}', r"top_k must be an integer, got -1.0 \(float\)"),  # -1 (an int) alone means no top-k
    ('{"top_k": -2}', "top_k must be >= 0"),
])
def test_parse_request_refuses_top_k_as_the_server_does(engine, params, says) -> None:
    """Triton reads vLLM's sampling parameters through the server's one reading (serving.sampling): a top_k below
    -1 or a float -1 is the config's error, not a silent "no top-k"."""
    with pytest.raises(ConfigError, match=says):
        parse_request({"text_input": _s("hi"), "sampling_parameters": _s(params)}, engine.generation_defaults)


def test_parse_request_null_sampling_parameter_is_the_default(engine) -> None:
    defaults = engine.generation_defaults
    req = parse_request({"text_input": _s("hi"), "sampling_parameters": _s('{"temperature": null, "top_p": null}')},
                        defaults)
    assert req.config == parse_request({"text_input": _s("hi")}, defaults).config


def test_prompt_near_the_model_length_gets_the_room_left_as_in_generate(engine) -> None:
    """Without max_tokens a long prompt was refused (prompt + the default 64 tokens over the model length), where
    engine.generate answers with the room left and finish_reason "length"."""
    room = 5
    ids = [7 + i % 50 for i in range(engine.manifest.max_seq_len - room)]
    prompt = engine.tokenizer.decode(ids)
    ids = engine.tokenizer.encode(prompt)
    req = parse_request({"text_input": _s(prompt), "stream": np.array([False])}, engine.generation_defaults)
    assert len(ids) + req.config.max_new_tokens > engine.manifest.max_seq_len
    with Scheduler(engine, max_slots=1) as sched:
        (text,) = response_texts(submit(sched, req), req.stream)
    alone = engine.generate([prompt], config=req.config)[0]
    assert text == alone.text and alone.finish_reason == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_response_texts_equal_generate(engine, stream: bool) -> None:
    inputs = {"text_input": _s(PROMPT), "max_tokens": np.array([12], np.int32), "stream": np.array([stream])}
    greedy = parse_request(inputs, engine.generation_defaults)
    sampled = parse_request({**inputs, "temperature": np.array([0.8], np.float32),
                             "random_seed": np.array([5], np.uint64)}, engine.generation_defaults)
    with Scheduler(engine, max_slots=2) as sched:
        texts = list(response_texts(submit(sched, greedy), greedy.stream))
        sampled_text = "".join(response_texts(submit(sched, sampled), sampled.stream))
    assert len(texts) > 1 if stream else len(texts) == 1
    assert "".join(texts) == engine.generate([PROMPT], config=greedy.config)[0].text
    assert sampled_text == engine.generate([PROMPT], config=sampled.config)[0].text


# --- model.py itself, in a harness ---------------------------------------------------------------------------
# HARNESS, not a Triton test: the stand-in below imitates the few names of Triton's `triton_python_backend_utils`
# that model.py calls, so that model.py's own code path (initialize -> execute -> response sender) runs here. What is
# under test is model.py and trtinfer's request logic; the stand-in only records what model.py sends.
class _StandInTensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self.name, self.value = name, value

    def as_numpy(self) -> np.ndarray:
        return self.value


class _StandInResponse:
    def __init__(self, output_tensors: list[_StandInTensor] | None = None, error: Any = None) -> None:
        self.output_tensors, self.error = output_tensors or [], error


class _StandInSender:
    def __init__(self) -> None:
        self.sent: list[tuple[_StandInResponse | None, int]] = []

    def send(self, response: _StandInResponse | None = None, flags: int = 0) -> None:
        self.sent.append((response, flags))


class _StandInRequest:
    def __init__(self, inputs: dict[str, np.ndarray]) -> None:
        self.inputs, self.sender = inputs, _StandInSender()

    def get_response_sender(self) -> _StandInSender:
        return self.sender


def _stand_in_pb_utils() -> types.ModuleType:
    mod = types.ModuleType("triton_python_backend_utils")
    mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1  # type: ignore[attr-defined]
    mod.Tensor = _StandInTensor  # type: ignore[attr-defined]
    mod.InferenceResponse = _StandInResponse  # type: ignore[attr-defined]
    mod.TritonError = lambda message: message  # type: ignore[attr-defined]
    mod.get_input_tensor_by_name = (  # type: ignore[attr-defined]
        lambda request, name: _StandInTensor(name, request.inputs[name]) if name in request.inputs else None)
    return mod


def _model_py(decoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> Any:
    """model.py of a repository written for ``decoder``, imported beside the stand-in utils and initialized."""
    model_dir = write_repository(decoder, tmp_path / "repo", TritonConfig(model_name="tiny"))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stand_in_pb_utils())
    spec = importlib.util.spec_from_file_location(f"tiny_triton_model_{tmp_path.name}", model_dir / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(model_dir), "model_version": "1",
                      "model_instance_device_id": "0"})
    return model


def test_model_py_in_harness(decoder: Path, engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model_py(decoder, tmp_path, monkeypatch, {"parameters": {"provider": {"string_value": "cpu"}}})
    # the KV cache `trtinfer serve` reserves by default, from the one policy (ServeConfig)
    assert model.scheduler.stats()["slots_total"] == ServeConfig().slots_for(engine.manifest.max_batch_size)
    assert model.scheduler.max_seq_len == ServeConfig().model_len_for(engine.manifest.max_seq_len)
    ok = _StandInRequest({"text_input": _s(PROMPT), "max_tokens": np.array([10], np.int32)})
    bad = _StandInRequest({"text_input": _s(PROMPT), "top_p": np.array([2.0], np.float32)})
    assert model.execute([ok, bad]) is None  # decoupled: everything goes through the senders
    _wait_final(ok.sender)
    *tokens, last = ok.sender.sent
    assert last == (None, 1) and len(tokens) > 1 and all(flags == 0 for _, flags in tokens)
    text = "".join(r.output_tensors[0].value[0].decode() for r, _ in tokens if r is not None)
    assert all(r is not None and r.output_tensors[0].name == "text_output" for r, _ in tokens)
    assert text == engine.generate([PROMPT], config=parse_request(
        {"text_input": _s(PROMPT), "max_tokens": np.array([10], np.int32)}, engine.generation_defaults).config)[0].text
    [(err, flags)] = bad.sender.sent
    assert flags == 1 and err is not None and "top_p" in err.error
    # several requests in one execute run together on the instance's batcher (batched decode steps)
    prompts = [PROMPT, "Hello", "A quick brown fox", "The history of the city"]
    many = [_StandInRequest({"text_input": _s(p), "max_tokens": np.array([10], np.int32),
                             "stream": np.array([False])}) for p in prompts]
    steps = model.scheduler.stats()["steps"]
    model.execute(many)
    for req in many:
        _wait_final(req.sender)
    cfg = parse_request({"text_input": _s(PROMPT), "max_tokens": np.array([10], np.int32)},
                        engine.generation_defaults).config
    want = [r.text for r in engine.generate(prompts, config=cfg)]
    assert [req.sender.sent[0][0].output_tensors[0].value[0].decode() for req in many] == want
    assert model.scheduler.stats()["steps"] - steps < 4 * 10  # one after another would take >= 4 x 10 steps
    model.finalize()


class _LeavingSender(_StandInSender):
    """A client that goes away after ``after`` responses (Triton's ``is_cancelled`` then says True)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def is_cancelled(self) -> bool:
        return len(self.sent) >= self.after


@pytest.mark.parametrize("stream", [True, False])
def test_model_py_stops_a_cancelled_request(decoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            stream: bool) -> None:
    """A request whose client left kept decoding to max_tokens in one of the instance's slots."""
    model = _model_py(decoder, tmp_path, monkeypatch, {})
    req = _StandInRequest({"text_input": _s(PROMPT), "max_tokens": np.array([200], np.int32),
                           "sampling_parameters": _s('{"ignore_eos": true}'), "stream": np.array([stream])})
    req.sender = _LeavingSender(after=2 if stream else 0)
    model.execute([req])
    _wait_final(req.sender)
    *responses, last = req.sender.sent
    assert last == (None, 1) and len(responses) == (2 if stream else 0)
    deadline = time.monotonic() + 30
    while model.scheduler.stats()["slots_used"]:
        assert time.monotonic() < deadline, "the cancelled request still holds its slot"
        time.sleep(0.01)
    assert model.scheduler.stats()["requests_finished"].get("cancelled") == 1
    assert model.scheduler.stats()["generation_tokens"] < 100
    model.finalize()


def _wait_final(sender: _StandInSender, timeout: float = 60) -> None:
    """Until the request's final flag was sent (its responses come from model.py's own thread)."""
    deadline = time.monotonic() + timeout
    while not (sender.sent and sender.sent[-1][1] == 1):
        assert time.monotonic() < deadline, "model.py sent no final response"
        time.sleep(0.01)
