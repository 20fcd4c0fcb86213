"""Every bad-input path of the runtime raises a typed error with a clear message."""
from __future__ import annotations

import json
import shutil

import pytest

import trtinfer
from trtinfer.errors import ConfigError, EngineLoadError, InputError


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
