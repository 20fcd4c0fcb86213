"""generate's hooks: a logits processor (transformers' hook), a cancel callback and max_time."""
from __future__ import annotations

import numpy as np
import pytest

import trtinfer
from trtinfer.errors import ConfigError, InputError

PROMPT = [[5, 17, 42, 99, 7, 3]]


def test_logits_processor_steers_tokens(tiny_engine):
    seen_rows = []

    def ban_all_but_seven(ids, logits):
        seen_rows.append([r.tolist() for r in ids])
        out = np.full_like(logits, -np.inf)
        out[:, 7] = 0.0
        return out

    with trtinfer.load(tiny_engine("llama")) as eng:
        r = eng.generate(input_ids=PROMPT, max_new_tokens=4, ignore_eos=True, logits_processor=ban_all_but_seven)[0]
        assert r.token_ids == [7, 7, 7, 7]
        assert seen_rows[0] == PROMPT and seen_rows[1] == [PROMPT[0] + [7]]  # prompt + generated ids so far
        with pytest.raises(InputError, match="logits_processor must return float logits of shape"):
            eng.generate(input_ids=PROMPT, max_new_tokens=2, logits_processor=lambda ids, x: x[:, :3])
        with pytest.raises(InputError, match="unknown generation option"):
            eng.generate(input_ids=PROMPT, logits_procesor=None)


def test_cancel_and_max_time(tiny_engine):
    calls = []

    def stop_after_three():
        calls.append(1)
        return len(calls) >= 3

    with trtinfer.load(tiny_engine("llama")) as eng:
        r = eng.generate(input_ids=PROMPT * 2, max_new_tokens=20, ignore_eos=True, should_stop=stop_after_three)
        assert [x.finish_reason for x in r] == ["cancelled", "cancelled"] and all(len(x.token_ids) == 3 for x in r)
        t = eng.generate(input_ids=PROMPT, max_new_tokens=50, ignore_eos=True, max_time=1e-9)[0]
        assert t.finish_reason == "length" and len(t.token_ids) == 1  # out of time after the first token
    with pytest.raises(ConfigError, match="max_time must be a positive number"):
        trtinfer.GenerationConfig(max_time=0)
