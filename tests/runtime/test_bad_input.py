"""Every bad-input path of the runtime raises a typed error with a clear message."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

import trtinfer
from trtinfer.errors import ConfigError, EngineLoadError, InputError
from trtinfer.runtime.config import GenerationConfig, RuntimeConfig


@pytest.fixture(scope="module")
def small_engine(tiny_engine):
    return tiny_engine("llama", max_batch_size=2, max_seq_len=24)


def test_limits(small_engine):
    with trtinfer.load(small_engine) as eng:
        with pytest.raises(InputError, match="max batch size 2"):
            eng.generate(["a", "b", "c"])
        with pytest.raises(InputError, match="max sequence length is 24"):
            eng.generate(input_ids=[list(range(5, 35))])
        with pytest.raises(InputError, match="empty"):
            eng.generate(input_ids=[[]])
        with pytest.raises(InputError, match="outside the vocabulary"):
            eng.generate(input_ids=[[1, 99999]])
        with pytest.raises(InputError, match="exactly one"):
            eng.generate(["a"], input_ids=[[1]])
        with pytest.raises(InputError, match="exactly one"):
            eng.generate()
        with pytest.raises(InputError, match="unknown generation option"):
            eng.generate(["a"], max_tokens=3)
        with pytest.raises(ConfigError, match="temperature"):
            eng.generate(["a"], temperature=0)
        with pytest.raises(ConfigError, match="top_p"):
            eng.generate(["a"], top_p=1.5)
        with pytest.raises(ConfigError, match="min_new_tokens"):
            eng.generate(["a"], max_new_tokens=2, min_new_tokens=5)
        # the engine's max_seq_len ends generation with "length"
        r = eng.generate(input_ids=[list(range(5, 25))], max_new_tokens=50, ignore_eos=True)[0]
        assert r.finish_reason == "length" and len(r.token_ids) == 4


@pytest.mark.parametrize("options", [{}, {"min_new_tokens": 2}, {"do_sample": True, "seed": 0}])
def test_eos_token_ids_outside_the_vocabulary(small_engine, options):
    """One ConfigError naming eos_token_ids and the vocabulary size, before anything runs (no IndexError in sampling)."""
    with trtinfer.load(small_engine) as eng:
        with pytest.raises(ConfigError, match=r"^eos_token_ids \[1000000000\] .*vocabulary of 320 tokens") as err:
            eng.generate(["a"], eos_token_ids=[0, 10**9], max_new_tokens=3, **options)
        assert err.value.field == "eos_token_ids"
        with pytest.raises(ConfigError, match="eos_token_ids"):
            list(eng.stream("a", eos_token_ids=[320], max_new_tokens=3, **options))
        assert len(eng.generate(["a"], eos_token_ids=[319], max_new_tokens=3, **options)[0].token_ids) >= 1


def test_bad_engine_dirs(small_engine, tmp_path):
    with pytest.raises(EngineLoadError, match="does not exist"):
        trtinfer.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineLoadError, match="manifest.json"):
        trtinfer.load(tmp_path / "empty")
    broken = tmp_path / "broken"
    shutil.copytree(small_engine, broken)
    (broken / "model.onnx").unlink()
    with pytest.raises(EngineLoadError, match="missing"):
        trtinfer.load(broken)
    old = tmp_path / "old"
    shutil.copytree(small_engine, old)
    m = json.loads((old / "manifest.json").read_text())
    m["manifest_version"] = 0
    (old / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineLoadError, match="rebuild"):
        trtinfer.load(old)
    with pytest.raises(ConfigError, match="provider"):
        trtinfer.load(small_engine, provider="tpu")
    garbage = tmp_path / "garbage"
    shutil.copytree(small_engine, garbage)
    (garbage / "model.onnx").write_bytes(b"not a graph\nat all")
    with pytest.raises(EngineLoadError, match=r"ONNX Runtime could not load .*; rebuild the engine$") as err:
        trtinfer.load(garbage)
    assert "\n" not in str(err.value)
    template = tmp_path / "template"
    shutil.copytree(small_engine, template)
    (template / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with trtinfer.load(template) as eng:
        with pytest.raises(EngineLoadError, match=r"chat_template.jinja is not a valid jinja template .*rebuild"):
            eng.generate(["hi"], chat=True, max_new_tokens=2)
        with pytest.raises(InputError, match="chat template failed to render"):  # a template given: the input's fault
            eng.tokenizer.apply_chat_template("hi", template="{% if %}")


# --- text that is not UTF-8 ------------------------------------------------------------------------------------
def test_prompts_with_lone_surrogates(small_engine):
    with trtinfer.load(small_engine) as eng:
        with pytest.raises(InputError, match=r"prompt 1 is not valid UTF-8 text \(byte 0xff at position 2\)"):
            eng.generate(["fine", "ok\udcff"])  # how os.fsdecode/sys.argv carry the byte 0xff
        with pytest.raises(InputError, match=r"prompt 0 is not valid UTF-8 text \(lone surrogate U\+D800"):
            list(eng.stream("x\ud800y"))
        with pytest.raises(InputError, match="not valid UTF-8"):
            list(eng.stream_batch(["a\udcfe"]))
        with pytest.raises(InputError, match="not valid UTF-8"):
            eng.generate(["\udcff"], chat=True)
        with pytest.raises(InputError, match="not valid UTF-8"):
            eng.tokenizer.encode("\udcc3(")


# --- generation and runtime options of the wrong type ------------------------------------------------------------
@pytest.mark.parametrize("options,field,expected", [
    ({"max_new_tokens": 2.5}, "max_new_tokens", "an integer, got 2.5 (float)"),
    ({"max_new_tokens": None}, "max_new_tokens", "an integer, got None"),
    ({"max_new_tokens": True}, "max_new_tokens", "an integer, got True (bool)"),
    ({"min_new_tokens": "1"}, "min_new_tokens", "an integer, got '1' (str)"),
    ({"temperature": "hot"}, "temperature", "a finite number, got 'hot' (str)"),
    ({"temperature": float("nan")}, "temperature", "a finite number, got nan"),
    ({"top_k": 1.5}, "top_k", "an integer, got 1.5"),
    ({"top_p": None}, "top_p", "a finite number, got None"),
    ({"repetition_penalty": [1.0]}, "repetition_penalty", "a finite number"),
    ({"do_sample": "yes"}, "do_sample", "True or False, got 'yes' (str)"),
    ({"ignore_eos": 1}, "ignore_eos", "True or False, got 1 (int)"),
    ({"seed": 1.5}, "seed", "a non-negative integer or None, got 1.5 (float)"),
    ({"seed": -1}, "seed", "a non-negative integer or None, got -1"),
    ({"stop": [1]}, "stop", "a list of non-empty strings, got [1]"),
    ({"stop": [""]}, "stop", "a list of non-empty strings"),
    ({"stop": 7}, "stop", "a list of non-empty strings, got 7 (int)"),
    ({"eos_token_ids": ["a"]}, "eos_token_ids", "a list of non-negative token ids or None, got ['a']"),
    ({"eos_token_ids": 2}, "eos_token_ids", "a list of non-negative token ids or None, got 2 (int)"),
])
def test_generation_config_types(options, field, expected):
    with pytest.raises(ConfigError, match=f"^{field} must be ") as err:
        GenerationConfig(**options)
    assert expected in str(err.value) and err.value.field == field


def test_generation_config_accepts_numpy_and_lists():
    cfg = GenerationConfig(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_p=1, stop="###",
                           eos_token_ids=[np.int64(2)])
    assert cfg.stop == ("###",) and cfg.eos_token_ids == (2,) and cfg.temperature == 0.5
    assert GenerationConfig(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("options,needle", [
    ({"provider": "tpu"}, "provider must be one of"),
    ({"provider": None}, "provider must be one of"),
    ({"device_id": "0"}, "device_id must be an integer, got '0' (str)"),
    ({"device_id": -1}, "device_id must be >= 0"),
    ({"intra_op_threads": 1.5}, "intra_op_threads must be an integer, got 1.5"),
    ({"intra_op_threads": -2}, "intra_op_threads must be >= 0"),
])
def test_runtime_config_types(options, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)) as err:
        RuntimeConfig(**options)
    assert err.value.field == next(iter(options))


def test_config_error_field_is_optional():
    err = ConfigError("plain message")
    assert str(err) == "plain message" and err.field is None
    assert ConfigError("x", field="top_k").field == "top_k"


def test_generate_takes_a_config(small_engine):
    with trtinfer.load(small_engine) as eng:
        cfg = GenerationConfig(max_new_tokens=3, ignore_eos=True)
        assert len(eng.generate(["a"], config=cfg)[0].token_ids) == 3
        assert len(eng.generate(["a"], config=cfg, max_new_tokens=2)[0].token_ids) == 2  # keywords override
        assert "".join(eng.stream("a", config=cfg))
        assert len([ev for ev in eng.stream_batch(["a"], config=cfg) if ev.token_id is not None]) == 3
        assert len(eng.generate(["a"], max_new_tokens=2, ignore_eos=True, stop=None)[0].token_ids) == 2
        with pytest.raises(ConfigError, match="max_new_tokens must be an integer, got 2.5"):
            eng.generate(["a"], max_new_tokens=2.5)
        with pytest.raises(ConfigError, match="temperature must be a finite number, got 'hot'"):
            eng.generate(["a"], config=cfg, temperature="hot")
        with pytest.raises(ConfigError, match="eos_token_ids"):
            eng.generate(["a"], eos_token_ids=["a"])
        with pytest.raises(InputError, match="config must be a GenerationConfig, got dict"):
            eng.generate(["a"], config={"max_new_tokens": 3})


# --- manifest.json of the wrong shape ---------------------------------------------------------------------------
def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(m):
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(m):
        for k in keys[:-1]:
            m = m[k]
        del m[keys[-1]]
    return edit


@pytest.mark.parametrize("edit,needle", [
    (_set("limits", "max_batch_size", "abc"), "limits.max_batch_size should be a positive integer, found 'abc'"),
    (_set("limits", "max_seq_len", 0), "limits.max_seq_len should be a positive integer, found 0"),
    (_set("limits", "max_seq_len", True), "limits.max_seq_len should be a positive integer, found True"),
    (_drop("limits", "max_seq_len"), "lacks 'limits.max_seq_len' (a positive integer)"),
    (_set("limits", [1]), "limits should be a JSON object, found a list ([1])"),
    (_set("geometry", "big"), "geometry should be a JSON object, found 'big'"),
    (_set("geometry", "vocab_size", "320"), "geometry.vocab_size should be a positive integer, found '320'"),
    (_drop("geometry", "num_kv_heads"), "lacks 'geometry.num_kv_heads'"),
    (_set("files", ["model.onnx"]), "files should be a JSON object"),
    (_set("files", "decoder", 3), "files.decoder should be a non-empty string, found 3"),
    (_drop("files", "decoder"), "lacks 'files.decoder'"),
    (_drop("io", "outputs"), "lacks 'io.outputs' (a JSON list)"),
    (_set("io", "inputs", {"input_ids": 1}), "io.inputs should be a JSON list"),
    (_set("io", "inputs", 0, "x"), "io.inputs[0] should be a JSON object with name, dtype and shape, found 'x'"),
    (_drop("io", "inputs", 1, "name"), "lacks 'io.inputs[1].name'"),
    (_set("io", "outputs", 0, "shape", "batch"), "io.outputs[0].shape should be a list of dimensions"),
    (_set("backend", 3), "backend should be a non-empty string, found 3"),
    (_set("kind", "vision"), "kind should be one of ['decoder', 'encoder'], found 'vision'"),
    (_set("kv_layout", "paged"), "kv_layout should be one of"),
    (_set("tokenizer", "pad_token_id", "0"), "tokenizer.pad_token_id should be a token id"),
    (_set("tokenizer", "eos_token_ids", [2, "x"]), "tokenizer.eos_token_ids should be a list of token ids"),
    (_set("manifest_version", True), "manifest version True"),
])
def test_malformed_manifest(small_engine, tmp_path, edit, needle):
    eng = tmp_path / "eng"
    shutil.copytree(small_engine, eng)
    m = json.loads((eng / "manifest.json").read_text())
    edit(m)
    (eng / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineLoadError) as err:
        trtinfer.load(eng)
    msg = str(err.value)
    assert needle in msg and str(eng / "manifest.json") in msg and msg.endswith("rebuild the engine")


@pytest.mark.parametrize("content,needle", [
    ("[1, 2]", "should hold a JSON object, found a list ([1, 2])"),
    ('"engine"', "should hold a JSON object, found 'engine'"),
    ("{}", "manifest version None"),
    ('{"manifest_version": 1, "limits": {"max_batch_size": "abc"}}', "lacks 'backend'"),
    ("{not json", "is not valid JSON"),
    (b'{"a\xff": 1}', "is not valid JSON ('utf-8' codec can't decode byte 0xff"),
])
def test_manifest_not_an_object(small_engine, tmp_path, content, needle):
    eng = tmp_path / "eng"
    shutil.copytree(small_engine, eng)
    (eng / "manifest.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(EngineLoadError, match="rebuild the engine") as err:
        trtinfer.load(eng)
    assert needle in str(err.value)


# --- encoder engines: no KV geometry; their own file roles ------------------------------------------------------
def _fake_encoder_engine(small_engine, out):
    """An encoder engine directory by hand: a 2-node graph (hidden = ids as float) and the tiny model's tokenizer."""
    import onnx
    from onnx import TensorProto, helper

    out.mkdir()
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["ids_f", "axes"], ["last_hidden_state"])],
        "fake_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", 1])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [2])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(out / "model.onnx"))
    shutil.copy(small_engine / "tokenizer.json", out / "tokenizer.json")
    manifest = {
        "manifest_version": 1, "kind": "encoder", "backend": "onnxruntime",
        "limits": {"max_batch_size": 4, "max_seq_len": 16},
        "geometry": {"num_layers": 1, "num_attention_heads": 1, "hidden_size": 1, "vocab_size": 320},
        "io": {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
                          {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"]}],
               "outputs": [{"name": "last_hidden_state", "dtype": "float32", "shape": ["batch", "sequence", 1]}]},
        "pooling": {"mode": "mean", "normalize": False},
        "files": {"encoder": "model.onnx"},
        "tokenizer": {"pad_token_id": 0, "cls_token": None, "sep_token": None},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_encoder_manifest_is_checked_per_kind(small_engine, tmp_path):
    enc = _fake_encoder_engine(small_engine, tmp_path / "enc")
    with trtinfer.load(enc) as eng:  # no num_kv_heads/head_dim: fine for an encoder
        assert eng.embed(["a b", "c"]).shape == (2, 1)
        with pytest.raises(InputError, match=r"text 1 is not valid UTF-8 text"):
            eng.embed(["fine", "bad \udcff bytes"])
    m = json.loads((enc / "manifest.json").read_text())
    m["files"] = {"decoder": "model.onnx"}
    (enc / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineLoadError, match=r"lacks 'files.encoder'.*rebuild the engine"):
        trtinfer.load(enc)
    m["files"] = {"encoder": "model.onnx"}
    m["geometry"] = {"num_layers": 1, "vocab_size": -1}
    (enc / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EngineLoadError, match="geometry.vocab_size should be a positive integer, found -1"):
        trtinfer.load(enc)


# --- tokenizer.json that is not a tokenizer ---------------------------------------------------------------------
@pytest.mark.parametrize("corrupt", ["truncated", "empty object", "empty file", "not utf-8"])
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_corrupt_tokenizer(small_engine, tmp_path, kind, corrupt):
    eng = tmp_path / "eng"
    if kind == "decoder":
        shutil.copytree(small_engine, eng)
    else:
        _fake_encoder_engine(small_engine, eng)
    text = (eng / "tokenizer.json").read_bytes()
    data = {"truncated": text[: len(text) // 2], "empty object": b"{}", "empty file": b"",
            "not utf-8": b"\xff\xfe{}"}[corrupt]
    (eng / "tokenizer.json").write_bytes(data)
    with pytest.raises(EngineLoadError) as err:
        trtinfer.load(eng)
    msg = str(err.value)
    assert f"{eng / 'tokenizer.json'} is not a readable tokenizer (" in msg and msg.endswith("rebuild the engine")


def test_missing_tokenizer_in_encoder(small_engine, tmp_path):
    enc = _fake_encoder_engine(small_engine, tmp_path / "enc")
    (enc / "tokenizer.json").unlink()
    with pytest.raises(EngineLoadError, match="has no tokenizer.json; rebuild the engine"):
        trtinfer.load(enc)


def test_a_closed_engine_refuses_work_and_frees_its_session(tiny_engine):
    from trtinfer.errors import EngineLoadError

    eng = trtinfer.load(tiny_engine("llama"))
    assert eng.generate(input_ids=[[5, 6, 7]], max_new_tokens=2)[0].token_ids
    eng.close()
    assert eng.session.sess is None and eng.session.prefill_sess is None  # the ONNX Runtime sessions are dropped
    for call in (lambda: eng.generate(input_ids=[[5, 6, 7]], max_new_tokens=2),
                 lambda: eng.score(input_ids=[[5, 6, 7]]), lambda: eng.perplexity(input_ids=[5, 6, 7])):
        with pytest.raises(EngineLoadError, match="is closed; load it again"):
            call()
    eng.close()  # twice is fine
    ctx = (eng := trtinfer.load(tiny_engine("llama"))).context(capacity=16)
    stream = eng.stream(input_ids=[5, 6, 7], max_new_tokens=8, ignore_eos=True)
    next(stream)
    eng.close()  # a context made before, a stream under way: one clear line, not an AttributeError inside
    with pytest.raises(EngineLoadError, match="engine was closed"):
        ctx.forward().input([5, 6]).execute()
    with pytest.raises(EngineLoadError, match="engine was closed"):
        list(stream)


@pytest.mark.parametrize(("call", "needle"), [
    (lambda e: e.generate(5), "prompts must be a string or a list of strings, got int"),
    (lambda e: e.generate(input_ids=np.array([1, 2, 3])), r"wrap one prompt's ids as \[ids\]"),
    (lambda e: e.generate(input_ids=[["a"]]), r"input_ids\[0\] must hold integer token ids, got 'a'"),
    (lambda e: e.generate(input_ids=[[1, None]]), "must hold integer token ids, got None"),
    (lambda e: e.generate(input_ids=[[1.5, 2.7]]), "got 1.5 .float."),  # refused, not rounded to [1, 2]
    (lambda e: e.generate(input_ids=[[True, 2]]), "got True .bool."),
    (lambda e: next(e.stream(input_ids=[[1, 2]])), r"input_ids must hold integer token ids, got \[1, 2\]"),
    (lambda e: next(e.stream(["a", "b"])), "stream_batch"),
    (lambda e: e.perplexity(input_ids=[[1, 2, 3]]), "must hold integer token ids"),
    (lambda e: e.perplexity(input_ids=[1, 2, 3], max_tokens=2.5), "max_tokens must be at least 2"),
    (lambda e: e.perplexity(input_ids=[1, 2, 3, 4], window=3.5), "window must be a whole number of tokens"),
    (lambda e: e.context(capacity=0), "capacity must be an integer between 2"),  # not silently the default
    (lambda e: e.generate([""], num_beams=2), "prompt 0 is empty"),  # not the scheduler's internals
    (lambda e: e.generate(input_ids=[[5, 6]], num_return_sequences=3, do_sample=True),
     "3 rows .prompts x num_return_sequences. exceed the engine's max batch size 2"),
])
def test_wrong_types_and_values_are_one_clear_line(small_engine, call, needle):
    with trtinfer.load(small_engine) as eng, pytest.raises(InputError, match=needle):
        call(eng)


def test_prompts_may_be_any_iterable(small_engine):
    with trtinfer.load(small_engine) as eng:  # a generator is read once (its emptiness was checked first)
        got = eng.generate((p for p in ["a b", "c"]), max_new_tokens=2, do_sample=False)
        assert [r.token_ids for r in got] == [r.token_ids for r in eng.generate(["a b", "c"], max_new_tokens=2,
                                                                                 do_sample=False)]


def test_load_refuses_what_is_not_a_runtime_option(small_engine):
    with pytest.raises(InputError, match=r"unknown runtime option\(s\) \['foo'\]"):
        trtinfer.load(small_engine, foo=1)
    with pytest.raises(InputError, match="config must be a RuntimeConfig, got dict"):
        trtinfer.load(small_engine, config={"provider": "cpu"})
    with pytest.raises(InputError, match="engine_dir must be a path"):
        trtinfer.load(None)


def test_a_released_context_refuses_fork_and_truncate(small_engine):
    """A released context's fork used to return a context of the right length over an empty KV cache (its logits
    20 away from the truth); now it and truncate refuse, as execute does."""
    with trtinfer.load(small_engine) as eng:
        ctx = eng.context(capacity=16)
        ctx.forward().input([5, 6, 7]).execute()
        ctx.release()
        for call in (ctx.fork, lambda: ctx.truncate(1), lambda: ctx.forward().input([8]).execute()):
            with pytest.raises(InputError, match="this context was released"):
                call()


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda x: np.where(np.arange(x.shape[-1]) == 100, np.nan, x), "returned NaN"),
    (lambda x: np.full_like(x, -np.inf), "-inf for every token of a row"),
])
def test_a_processor_returning_no_choosable_token_is_refused(small_engine, edit, needle):
    with trtinfer.load(small_engine) as eng:
        for sample in (False, True):
            with pytest.raises(InputError, match=needle):
                eng.generate(input_ids=[[5, 6, 7]], max_new_tokens=3, do_sample=sample,
                             logits_processor=lambda ids, x: edit(x))
        forced = eng.generate(input_ids=[[5, 6, 7]], max_new_tokens=2, do_sample=False,  # +inf forces a token
                              logits_processor=lambda ids, x: np.where(np.arange(x.shape[-1]) == 9, np.inf, x))
        assert forced[0].token_ids == [9, 9]


# --- found by a review of the Python API ----------------------------------------------------------------------
def test_a_bad_probe_is_refused_before_the_pass_runs(small_engine):
    """Logprob(9999) was checked after the pass ran: the context had taken the tokens and the pass was spent."""
    from trtinfer.runtime.probes import Distribution, Logprob, Logprobs

    with trtinfer.load(small_engine) as eng:
        ctx = eng.context()
        ctx.forward().input([5, 6, 7]).execute()
        f = ctx.forward().input([8, 9])
        for bad in (Logprob(9999), Logprobs([3, -1])):
            with pytest.raises(InputError, match="outside the vocabulary"):
                f.probe(-1, bad)
        for bad in (Logprob(True), Logprobs([3, 4.0])):  # True was read as id 1
            with pytest.raises(InputError, match="must hold integer token ids"):
                f.probe(-1, bad)
        assert ctx.tokens == [5, 6, 7]
        h = f.probe(-1, Logprob(9))
        assert isinstance(f.execute().logprobs(h), float) and ctx.tokens == [5, 6, 7, 8, 9]
        for t, k in (("x", 5), (1e-40, 5), (1.0, 2.5)):
            with pytest.raises(InputError, match="Distribution needs a finite temperature"):
                Distribution(temperature=t, k=k)
        assert Distribution(k=np.int64(5)).k == 5


def test_numbers_of_any_integer_type_and_wrong_types_say_so(small_engine):
    with trtinfer.load(small_engine) as eng:
        for bad in ("8", 8.0, 1, 99):
            with pytest.raises(InputError, match="capacity must be an integer between 2"):
                eng.context(capacity=bad)
            with pytest.raises(InputError, match="capacity must be an integer between 2"):
                eng.contexts(2, capacity=bad)
        assert eng.context(capacity=np.int64(8)).capacity == 8
        assert len(eng.contexts(np.int64(2))) == 2
        ids = list(range(5, 15))
        assert eng.perplexity(input_ids=ids, max_tokens=np.int64(5)).perplexity == \
            eng.perplexity(input_ids=ids, max_tokens=5).perplexity
        # an extreme length penalty: scores divided by inf, not an OverflowError
        assert eng.generate(input_ids=[ids[:3]], num_beams=2, max_new_tokens=3, length_penalty=1e300)


def test_a_tiny_temperature_samples_greedily(small_engine):
    """float32 logits / 1e-40 overflowed: the draw fell on the last id (or EOS) whatever the seed."""
    with trtinfer.load(small_engine) as eng:
        greedy = eng.generate(input_ids=[[5, 6, 7]], max_new_tokens=6, ignore_eos=True)[0].token_ids
        for t in (1e-40, 1e-300, 1e-6):
            for seed in (0, 1):
                got = eng.generate(input_ids=[[5, 6, 7]], max_new_tokens=6, ignore_eos=True, do_sample=True,
                                   temperature=t, top_k=0, seed=seed)[0].token_ids
                assert got == greedy, (t, seed)


def test_beams_on_a_sampling_engine_check_their_type(small_engine, tmp_path):
    """On an engine whose generation_config.json samples (Gemma-3, Llama-3, Qwen ship do_sample true), num_beams="x"
    was a raw ValueError (int("x")) instead of the ConfigError other engines give."""
    eng_dir = shutil.copytree(small_engine, tmp_path / "sampling")
    cfg = json.loads((eng_dir / "generation_config.json").read_text()) \
        if (eng_dir / "generation_config.json").is_file() else {}
    (eng_dir / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": True, "temperature": 0.7}))
    with trtinfer.load(eng_dir) as eng:
        assert eng.generation_defaults.do_sample
        for bad in ("x", None, 2.5):
            with pytest.raises(ConfigError, match="num_beams"):
                eng.generate(input_ids=[[5, 6]], num_beams=bad)


def test_a_grammar_with_settings_that_ban_all_it_allows_is_one_line(small_engine):
    pytest.importorskip("llguidance")
    with trtinfer.load(small_engine) as eng:
        fmt = {"type": "choice", "choice": ["yes yes", "no no"]}
        with pytest.raises(InputError) as e:
            eng.generate(input_ids=[[5, 6]], response_format=fmt, no_repeat_ngram_size=1, max_new_tokens=8)
    assert "no token the response_format allows is left" in str(e.value) and "\n" not in str(e.value)
