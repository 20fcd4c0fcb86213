"""A prompt that leaves less room than max_new_tokens below the engine's max_seq_len is warned about, once per call."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import trtinfer

MAX_SEQ = 24
CUT_SHORT = ("prompt 0 has 20 tokens, which leaves room for only 4 of the 16 requested new tokens within the engine's "
             "max sequence length 24; shorten the prompt or rebuild the engine with a larger --max-seq-len")


@pytest.fixture(scope="module")
def engine_dir(tiny_engine):
    return tiny_engine("llama", max_batch_size=2, max_seq_len=MAX_SEQ)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_prompt_near_max_seq_len_warns_once(engine_dir, caplog):
    long, short = list(range(5, 25)), list(range(5, 9))
    with trtinfer.load(engine_dir) as eng, caplog.at_level(logging.WARNING, logger="trtinfer"):
        [r] = eng.generate(input_ids=[long], max_new_tokens=16, min_new_tokens=16)
        assert len(r.token_ids) == MAX_SEQ - len(long) and r.finish_reason == "length"
        assert _warnings(caplog) == [CUT_SHORT]

        caplog.clear()
        eng.generate(input_ids=[short], max_new_tokens=16)  # 4 + 16 fits in 24
        eng.generate(input_ids=[long], max_new_tokens=4)  # exactly fills it
        assert _warnings(caplog) == []

        caplog.clear()
        list(eng.stream_batch(input_ids=[short, long], max_new_tokens=21))  # one warning per call, naming the worst row
        assert _warnings(caplog) == [(
            "prompt 1 has 20 tokens, which leaves room for only 4 of the 21 requested new tokens within the engine's "
            "max sequence length 24 (1 other prompt(s) are cut short too); shorten the prompt or rebuild the engine "
            "with a larger --max-seq-len")]


def test_cli_shows_the_warning_without_verbose(engine_dir):
    with trtinfer.load(engine_dir) as eng:
        words = ["hello"]
        while len(eng.tokenizer.encode(" ".join(words))) < MAX_SEQ - 2:
            words.append("hello")
        n = len(eng.tokenizer.encode(" ".join(words)))
    p = subprocess.run([sys.executable, "-m", "trtinfer", "generate", str(engine_dir), "-n", "16", "-p",
                        " ".join(words)], capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stderr
    assert (f"warning: prompt 0 has {n} tokens, which leaves room for only {MAX_SEQ - n} of the 16 requested new "
            f"tokens within the engine's max sequence length {MAX_SEQ}") in p.stderr, p.stderr
