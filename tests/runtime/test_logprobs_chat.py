"""``generate(logprobs=True, top_logprobs=k)`` and chat prompts given as conversations."""
from __future__ import annotations

import numpy as np
import pytest

import trtinfer
from trtinfer.errors import ConfigError, InputError

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 60], [8, 9, 10]]


def test_logprobs_equal_scoring_the_generated_sequence(tiny_engine):
    with trtinfer.load(tiny_engine("llama")) as eng:
        res = eng.generate(input_ids=PROMPTS, max_new_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3)
        plain = eng.generate(input_ids=PROMPTS, max_new_tokens=5, ignore_eos=True)
        for r, p in zip(res, plain):
            assert r.token_ids == p.token_ids  # asking for log-probs does not change greedy tokens
            assert r.logprobs is not None and [t.token_id for t in r.logprobs] == r.token_ids
            scored = eng.score(input_ids=[r.prompt_ids + r.token_ids])[0].logprobs[-len(r.token_ids):]
            np.testing.assert_allclose([t.logprob for t in r.logprobs], scored, atol=1e-4)
            for t in r.logprobs:  # greedy: the chosen token is the top alternative; alternatives sorted
                assert t.top[0][0] == t.token_id and len(t.top) == 3
                assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
        assert plain[0].logprobs is None
    with pytest.raises(ConfigError, match="top_logprobs must be within 0..20 and needs logprobs=True"):
        trtinfer.GenerationConfig(top_logprobs=2)


def test_chat_takes_a_conversation(tiny_engine):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "The history of the city"}]
    with trtinfer.load(tiny_engine("llama")) as eng:
        ids = eng.tokenizer.encode_chat(conv)
        text = eng.tokenizer.apply_chat_template(conv)
        assert text.count("<|im_start|>") == 5 and text.index("system") < text.index("assistant")
        got = eng.generate([conv, "Hello"], chat=True, max_new_tokens=4, ignore_eos=True)
        assert got[0].prompt_ids == ids
        assert got[1].prompt_ids == eng.tokenizer.encode_chat("Hello")
        with pytest.raises(InputError, match="chat prompt 0 must be a string or a non-empty list"):
            eng.generate([[{"role": "user"}]], chat=True)
