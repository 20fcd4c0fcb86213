"""Assisted decoding (``generate(..., assistant=engine)``) on tiny engines: greedy and seeded sampling give plain
decoding's tokens whatever the assistant (the engine itself: every draft kept; its int4 build: some kept; another
model of the same tokenizer: most rejected), the draft-length schedules, stop rules, streaming, and refusals."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest

import trtinfer
from trtinfer.errors import ConfigError, InputError
from trtinfer.runtime.config import GenerationConfig

PROMPTS = ["The history of the city of Paris begins in antiquity. The history of the city", "Hello world! 0123",
           "A quick brown fox"]


@pytest.fixture(scope="module")
def target(tiny_engine):
    with trtinfer.load(tiny_engine("llama")) as eng:
        yield eng


@pytest.fixture(scope="module", params=["itself", "int4", "other model"])
def assistant(request, tiny_engine, target):
    if request.param == "itself":
        yield request.param, target
        return
    path = tiny_engine("llama", precision="int4") if request.param == "int4" else tiny_engine("mistral")
    with trtinfer.load(path) as eng:
        yield request.param, eng


@dataclass
class Stats:
    drafted: int
    accepted: int
    passes: int  # the engine's passes after the prompt's: each keeps its accepted draft tokens + one of its own


def _stats(r) -> Stats:
    return Stats(r.draft_tokens, r.accepted_tokens, len(r.token_ids) - 1 - r.accepted_tokens)


def _assisted(target, prompts, assistant, **kw):
    got = target.generate(prompts, assistant=assistant, **kw)
    return got, [_stats(r) for r in got]


def test_greedy_is_plain_greedy(target, assistant):
    kind, eng = assistant
    plain = target.generate(PROMPTS, max_new_tokens=40, do_sample=False, ignore_eos=True)
    got, stats = _assisted(target, PROMPTS, eng, max_new_tokens=40, do_sample=False, ignore_eos=True,
                           num_assistant_tokens=3)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert [r.text for r in got] == [r.text for r in plain]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 40 for r in got)
    drafted, accepted, passes = (sum(getattr(s, f) for s in stats) for f in ("drafted", "accepted", "passes"))
    assert drafted > 0
    if kind == "itself":  # the same model drafts exactly what it will choose
        assert accepted == drafted and passes <= 3 * 5  # drafts of 3, 5, 7, 9, 11 per prompt
    else:
        assert accepted < drafted


def test_seeded_sampling_is_plain_sampling(target, assistant):
    _, eng = assistant
    kw = {"max_new_tokens": 24, "do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 7, "ignore_eos": True}
    plain = target.generate(PROMPTS[:2], **kw)
    got, _ = _assisted(target, PROMPTS[:2], eng, num_assistant_tokens=4, **kw)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]


def test_stop_string_and_eos_as_plain(target, tiny_engine):
    with trtinfer.load(tiny_engine("llama", precision="int4")) as eng:
        plain = target.generate(PROMPTS, max_new_tokens=30, do_sample=False)
        text = plain[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3] if len(text) > 8 else None
        kw = {"max_new_tokens": 30, "do_sample": False, "stop": [stop] if stop else []}
        want = target.generate(PROMPTS, **kw)
        got = target.generate(PROMPTS, assistant=eng, num_assistant_tokens=5, **kw)
        assert [(r.token_ids, r.text, r.finish_reason, r.stop_reason) for r in got] == \
               [(r.token_ids, r.text, r.finish_reason, r.stop_reason) for r in want]
        streamed = "".join(target.stream(PROMPTS[0], assistant=eng, **kw))
        assert streamed == want[0].text


def test_schedules(target):
    kw = {"max_new_tokens": 40, "do_sample": False, "ignore_eos": True, "num_assistant_tokens": 2}
    _, constant = _assisted(target, PROMPTS[:1], target, num_assistant_tokens_schedule="constant", **kw)
    _, heuristic = _assisted(target, PROMPTS[:1], target, **kw)
    c, h = constant[0], heuristic[0]
    assert c.accepted == c.drafted and h.accepted == h.drafted  # the engine drafting for itself: all kept
    assert c.drafted == 2 * c.passes  # 2 per pass, and each pass keeps them + one of its own
    assert c.passes == 13  # 39 tokens after the first, 3 per pass
    assert h.passes == 6  # drafts of 2, 4, 6, 8, 10 (+1 each): 35 tokens after the first, then 3 + 1 to reach 40
    assert h.drafted == 2 + 4 + 6 + 8 + 10 + 3


def test_refusals(target, tiny_engine, tmp_path):
    with pytest.raises(InputError, match="^assistant must be a decoder Engine"):
        target.generate("Hi", assistant="engines/other")
    bad = tmp_path / "engine"
    shutil.copytree(tiny_engine("llama"), bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids: same size, other ids
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    with trtinfer.load(bad) as other, pytest.raises(InputError, match="^the assistant's vocabulary differs"):
        target.generate("Hi", assistant=other)
    with trtinfer.load(tiny_engine("llama", disable_passes=("logits_positions",))) as old, \
            pytest.raises(InputError, match="^the assistant engine computes logits at the last position only"):
        target.generate("Hi", assistant=old)
    closed = trtinfer.load(tiny_engine("mistral"))
    closed.close()
    with pytest.raises(InputError, match="^the assistant engine is closed"):
        target.generate("Hi", assistant=closed)
    with pytest.raises(InputError, match="^assistant and prompt_lookup_num_tokens are two ways of drafting"):
        target.generate("Hi", assistant=target, prompt_lookup_num_tokens=3)
    with pytest.raises(InputError, match="^assistant drafts for one sequence per prompt"):
        target.generate("Hi", assistant=target, num_beams=2)
    with pytest.raises(ConfigError, match="^num_assistant_tokens must be >= 1"):
        GenerationConfig(num_assistant_tokens=0)
    with pytest.raises(ConfigError, match="^num_assistant_tokens_schedule must be"):
        target.generate("Hi", assistant=target, num_assistant_tokens_schedule="sometimes")


def test_cli(tiny_engine):
    import subprocess
    import sys

    eng, draft = tiny_engine("llama"), tiny_engine("llama", precision="int4")

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trtinfer", "generate", str(eng), "-p", PROMPTS[0], "-n", "16",
                               "--greedy", "--json", *extra], check=False, capture_output=True, text=True, timeout=300)

    plain, assisted = cli(), cli("--assistant", str(draft), "--num-assistant-tokens", "3")
    assert plain.returncode == 0 and assisted.returncode == 0, assisted.stderr
    assert [r["token_ids"] for r in json.loads(assisted.stdout)] == [r["token_ids"] for r in json.loads(plain.stdout)]
    bad = cli("--num-assistant-tokens", "3")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [("trtinfer generate: error: --num-assistant-tokens needs --assistant "
                                               "ENGINE_DIR")]


def test_assistant_cache_is_reused_and_released(target, tiny_engine, monkeypatch):
    """The assistant is fed the prompt once, then per step only what it has not seen (the engine's own token, a
    draft token to continue from); its KV buffers go when the generation ends."""
    with trtinfer.load(tiny_engine("llama", precision="int4")) as eng:
        fed: list[int] = []
        run_rows = eng.session.run_rows  # every pass of the assistant's context

        def counting(feeds, *a, **kw):
            fed.append(feeds["input_ids"].shape[1])
            return run_rows(feeds, *a, **kw)

        monkeypatch.setattr(eng.session, "run_rows", counting)
        prompt = eng.tokenizer.encode(PROMPTS[0])
        (r,) = target.generate(input_ids=[prompt], max_new_tokens=30, do_sample=False, ignore_eos=True, assistant=eng,
                               num_assistant_tokens=4, num_assistant_tokens_schedule="constant")
        st = _stats(r)
    assert fed[0] == len(prompt) + 1  # the prompt and the engine's first token, once
    assert max(fed[1:]) <= 2  # later passes: one or two tokens, never the sequence again
    # each token of the final sequence is fed at most once; beyond that only rejected draft tokens
    assert sum(fed) <= len(prompt) + len(r.token_ids) + (st.drafted - st.accepted)
    assert st.drafted > st.accepted  # the int4 build disagrees somewhere: the rollback ran
