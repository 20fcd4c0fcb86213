"""An engine's generation_config.json supplies generate's defaults (as transformers reads it); calls override them."""
from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest

import trtinfer
from trtinfer.runtime.config import GenerationConfig

IDS = [[5, 17, 42, 99, 7]]


@pytest.fixture(scope="module")
def base(tiny_engine):
    return tiny_engine("llama")


def engine_with(base, tmp_path, settings):
    """A copy of the tiny engine whose generation_config.json holds ``settings`` (over the model's own)."""
    out = tmp_path / "engine"
    shutil.copytree(base, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return out


def test_defaults_read_and_overridden(base, tmp_path, caplog):
    eng_dir = engine_with(base, tmp_path, {"do_sample": True, "top_k": 3, "temperature": 0.5, "max_new_tokens": 7,
                                           "repetition_penalty": -1, "num_beams": None, "use_cache": True})
    with caplog.at_level(logging.WARNING, logger="trtinfer"), trtinfer.load(eng_dir) as eng:
        d = eng.generation_defaults
        assert (d.do_sample, d.top_k, d.temperature, d.max_new_tokens) == (True, 3, 0.5, 7)
        assert d.repetition_penalty == 1.0 and d.num_beams == 1  # a refused value and a null keep the defaults
        assert "ignoring repetition_penalty=-1" in caplog.text
        got = eng.generate(input_ids=IDS, seed=11, ignore_eos=True)[0].token_ids
        explicit = eng.generate(input_ids=IDS, config=GenerationConfig(do_sample=True, top_k=3, temperature=0.5,
                                                                        max_new_tokens=7, seed=11, ignore_eos=True))
        assert len(got) == 7 and got == explicit[0].token_ids  # the file's settings, as if passed
        greedy = eng.generate(input_ids=IDS, do_sample=False, ignore_eos=True)[0].token_ids
    with trtinfer.load(base) as plain:
        assert plain.generation_defaults == GenerationConfig()  # the tiny model's file sets no decoding option
        assert greedy == plain.generate(input_ids=IDS, max_new_tokens=7, ignore_eos=True)[0].token_ids


def test_beam_default_and_cli(base, tmp_path):
    eng_dir = engine_with(base, tmp_path, {"num_beams": 2, "max_new_tokens": 5})
    with trtinfer.load(eng_dir) as eng:
        r = eng.generate(input_ids=IDS, ignore_eos=True)[0]
        assert r.score is not None and len(r.token_ids) == 5  # beam search, from the file
    cli = [sys.executable, "-m", "trtinfer", "generate", str(eng_dir), "-p", "Hello", "--json"]
    out = json.loads(subprocess.run([*cli, "--num-return-sequences", "2"], capture_output=True, text=True,
                                    check=True).stdout)
    assert len(out) == 2 and all("score" in r for r in out) and out[0]["score"] >= out[1]["score"]
    out = json.loads(subprocess.run([*cli, "--num-beams", "1", "--logprobs", "--top-logprobs", "2"],
                                    capture_output=True, text=True, check=True).stdout)
    assert len(out) == 1 and "score" not in out[0]
    assert len(out[0]["logprobs"]) == len(out[0]["token_ids"]) and len(out[0]["logprobs"][0]["top_logprobs"]) == 2
    bad = subprocess.run([*cli, "--num-beams", "2", "--sample"], check=False, capture_output=True, text=True)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0
    assert "beam search (--num-beams=2) does not combine with --sample" in bad.stderr
