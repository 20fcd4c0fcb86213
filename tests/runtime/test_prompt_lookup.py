"""Prompt-lookup decoding on tiny engines of the three KV layouts: the same results as plain decoding, with drafts
accepted; EOS, max_new_tokens and stop strings where a draft would go on; sampling, processors, hooks; refusals."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from tiny_models import stage_engine, whole_stage

import trtinfer
from trtinfer.errors import ConfigError, InputError
from trtinfer.export import ExportConfig
from trtinfer.export.onnx_export import export_cached
from trtinfer.passes import PassConfig
from trtinfer.passes.optimizer import optimize_cached
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.generator import GenerationResult
from trtinfer.runtime.offline import Generation
from trtinfer.runtime.proposers import NgramIndex
from trtinfer.runtime.scoring import open_stage_session
from trtinfer.runtime.tokenizer import EngineTokenizer

#: the tiny llama copies from this prompt's second half and loops in its own output: drafts get accepted
REPEAT = "The history of the city of Paris begins in antiquity. The history of the city of Paris"
#: nothing here repeats: drafts come only from the model's own output
PLAIN = "Hello world! Numbers 0123456789"
SCATTER_MAX_SEQ = 160


@dataclass
class Stats:
    drafted: int
    accepted: int


@dataclass
class Runner:
    """One engine (or a stage's session standing for one) driven by the runtime's generation loop."""

    engine: Any

    @property
    def tok(self) -> EngineTokenizer:
        return self.engine.tokenizer  # type: ignore[no-any-return]

    @property
    def max_seq_len(self) -> int:
        return int(self.engine.manifest.max_seq_len)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def plain(self, prompts: list[list[int]], **kw: Any) -> list[GenerationResult]:
        return Generation(self.engine, prompts, GenerationConfig(**kw)).run()

    def lookup(self, prompts: list[list[int]], k: int = 4, **kw: Any) -> tuple[list[GenerationResult], list[Stats]]:
        got = Generation(self.engine, prompts, GenerationConfig(prompt_lookup_num_tokens=k, **kw)).run()
        return got, [Stats(r.draft_tokens, r.accepted_tokens) for r in got]


@pytest.fixture(scope="module", params=["shared_buffer", "concat", "scatter_buffer"])
def runner(request, tiny_model_dir, tiny_engine):
    if request.param == "scatter_buffer":  # the tensorrt target's graph, on ONNX Runtime's CPU
        stage = optimize_cached(export_cached(tiny_model_dir("llama"), ExportConfig()),
                                PassConfig(target="tensorrt", max_seq_len=SCATTER_MAX_SEQ))
        with open_stage_session(whole_stage(stage)) as session:
            assert session.kv_layout == "scatter_buffer"
            tok = EngineTokenizer(stage.path, stage.info.get("tokenizer", {}))
            yield Runner(stage_engine(session, tok, 1, SCATTER_MAX_SEQ))
        return
    kw = {} if request.param == "shared_buffer" else {"disable_passes": ("attention",)}
    with trtinfer.load(tiny_engine("llama", **kw)) as eng:
        assert eng.session.kv_layout == request.param
        yield Runner(eng)


def replay(prompt: list[int], out: list[int], k: int, limit: int, n: int = 2) -> list[tuple[int, list[int], int]]:
    """The passes prompt lookup makes when the model's choices are ``out``: (index in out where the pass's tokens
    start, its draft, how many draft tokens match), from the lookup alone."""
    index = NgramIndex(n)
    index.extend(prompt + out[:1])
    j, passes = 1, []
    while j < len(out):
        draft = index.draft(min(k, limit - len(index.tokens) - 1))
        m = 0
        while m < len(draft) and j + m < len(out) and draft[m] == out[j + m]:
            m += 1
        passes.append((j, draft, m))
        index.extend(out[j:j + m + 1])
        j += m + 1
    return passes


def same(a: GenerationResult, b: GenerationResult) -> None:
    assert (a.token_ids, a.text, a.finish_reason, a.stop_reason, a.prompt_ids) == (
        b.token_ids, b.text, b.finish_reason, b.stop_reason, b.prompt_ids)


def repeat_prompt(r: Runner) -> list[int]:
    """REPEAT followed by the model's own continuation of it: the model then repeats tokens first seen in the
    prompt, so some accepted drafts hold a token the output has not had yet."""
    ids = r.ids(REPEAT)
    return ids + r.plain([ids], max_new_tokens=30, ignore_eos=True)[0].token_ids


def test_ngram_index_is_transformers_lookup():
    index = NgramIndex(2)
    index.extend([1, 2, 3, 1, 2, 4, 1, 2])
    assert index.draft(3) == [3, 1, 2]  # the leftmost earlier (1, 2), not the nearer one
    index.extend([9, 1])
    assert index.draft(2) == [2, 3]  # (9, 1) never occurred: the 1-gram 1, leftmost
    index.extend([7])
    assert index.draft(4) == []  # 7 occurs only as the suffix itself
    assert index.draft(0) == []


@pytest.mark.parametrize("text", [REPEAT, PLAIN])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_equals_plain_greedy(runner, text, k):
    prompt = runner.ids(text)
    want = runner.plain([prompt], max_new_tokens=40, ignore_eos=True)[0]
    (got,), (stats,) = runner.lookup([prompt], k, max_new_tokens=40, ignore_eos=True)
    same(got, want)
    passes = replay(prompt, want.token_ids, k, len(prompt) + 40)
    assert stats.drafted == sum(len(d) for _, d, _ in passes)
    assert stats.accepted == sum(m for _, _, m in passes)
    if text == REPEAT:
        assert stats.accepted > 0
    assert len(got.timings.decode_ms) == len(got.token_ids) - 1 and got.timings.prefill_ms > 0


def test_eos_where_an_accepted_draft_goes_on(runner):
    prompt = repeat_prompt(runner)
    out = runner.plain([prompt], max_new_tokens=40, ignore_eos=True)[0].token_ids
    # a token of an accepted draft, after another accepted one, that the output has not had before
    inside = [(j, t) for j, _, m in replay(prompt, out, 4, len(prompt) + 40) for t in range(1, m)
              if out[j + t] not in out[:j + t]]
    assert inside, "pick a prompt whose output repeats prompt tokens"
    j, t = inside[0]
    eos = out[j + t]
    want = runner.plain([prompt], max_new_tokens=40, eos_token_ids=[eos])[0]
    assert want.token_ids == out[:j + t + 1] and want.stop_reason == eos
    (got,), (stats,) = runner.lookup([prompt], 4, max_new_tokens=40, eos_token_ids=[eos])
    same(got, want)
    assert stats.accepted > 0


def test_max_new_tokens_inside_a_draft(runner):
    prompt = runner.ids(REPEAT)
    out = runner.plain([prompt], max_new_tokens=40, ignore_eos=True)[0].token_ids
    long = [(j, m) for j, _, m in replay(prompt, out, 4, len(prompt) + 40) if m >= 3]
    assert long
    j, _ = long[0]
    n = j + 2  # the pass at j would accept 3+ tokens; the limit allows 2
    want = runner.plain([prompt], max_new_tokens=n, ignore_eos=True)[0]
    (got,), _ = runner.lookup([prompt], 4, max_new_tokens=n, ignore_eos=True)
    same(got, want)
    assert got.finish_reason == "length" and len(got.token_ids) == n


def test_stop_string_inside_a_draft(runner):
    prompt = runner.ids(REPEAT)
    out = runner.plain([prompt], max_new_tokens=40, ignore_eos=True)[0].token_ids
    j, _ = next((j, m) for j, _, m in replay(prompt, out, 4, len(prompt) + 40) if m >= 3)
    stop = runner.tok.decode(out[j + 1:j + 3]).strip()
    assert stop
    want = runner.plain([prompt], max_new_tokens=40, ignore_eos=True, stop=[stop])[0]
    assert want.finish_reason == "stop" and want.stop_reason == stop
    (got,), _ = runner.lookup([prompt], 4, max_new_tokens=40, ignore_eos=True, stop=[stop])
    same(got, want)


def test_prompt_near_max_seq_len(runner):
    """The row's prompt + output reaches the engine's max_seq_len inside a draft: it stops there, as plain."""
    unit = runner.ids(REPEAT)
    prompt = (unit * (runner.max_seq_len // len(unit) + 1))[:runner.max_seq_len - 3]
    want = runner.plain([prompt], max_new_tokens=10, ignore_eos=True)[0]
    (got,), _ = runner.lookup([prompt], 10, max_new_tokens=10, ignore_eos=True)
    same(got, want)
    assert len(got.token_ids) == 3 and got.finish_reason == "length"
    prompt = prompt + prompt[:2]  # one token of room
    (got,), (stats,) = runner.lookup([prompt], 10, max_new_tokens=10, ignore_eos=True)
    same(got, runner.plain([prompt], max_new_tokens=10, ignore_eos=True)[0])
    assert len(got.token_ids) == 1 and stats.drafted == 0


def test_sampling_draws_plain_samplings_tokens(runner):
    """One uniform per kept token from the prompt's own generator: the seed gives plain sampling's tokens."""
    prompt = runner.ids(REPEAT)
    kw = {"do_sample": True, "temperature": 0.3, "top_k": 20, "seed": 7, "max_new_tokens": 30, "ignore_eos": True}
    want = runner.plain([prompt], **kw)[0]
    (got,), (stats,) = runner.lookup([prompt], 4, **kw)
    same(got, want)
    assert stats.accepted > 0


def test_processors_hook_and_logprobs_equal_plain(runner):
    prompt = runner.ids(REPEAT)
    seen_lengths: list[int] = []

    def hook(ids, logits):
        seen_lengths.append(len(ids[0]))
        out = logits.copy()
        out[:, 5] -= 1.0
        return out

    kw = {"repetition_penalty": 1.1, "min_new_tokens": 6, "logprobs": True, "top_logprobs": 3,
          "max_new_tokens": 30}
    want = Generation(runner.engine, [prompt], GenerationConfig(**kw), logits_processor=hook).run()[0]
    plain_calls, seen_lengths[:] = list(seen_lengths), []
    got = Generation(runner.engine, [prompt], GenerationConfig(prompt_lookup_num_tokens=4, **kw),
                     logits_processor=hook).run()[0]
    same(got, want)
    assert got.logprobs is not None and want.logprobs is not None and len(got.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # the hook saw each kept token's prefix, as plain decoding shows it (rejected positions come on top)
    assert set(plain_calls) <= set(seen_lengths)


def test_no_repeat_ngram_equals_plain(runner):
    prompt = runner.ids(REPEAT)
    want = runner.plain([prompt], no_repeat_ngram_size=3, max_new_tokens=30, ignore_eos=True)[0]
    (got,), _ = runner.lookup([prompt], 4, no_repeat_ngram_size=3, max_new_tokens=30, ignore_eos=True)
    same(got, want)


def test_batch_of_two_and_streaming(tiny_engine):
    with trtinfer.load(tiny_engine("llama")) as eng:
        prompts = [REPEAT, PLAIN]
        want = eng.generate(prompts, max_new_tokens=24, ignore_eos=True)
        got = eng.generate(prompts, max_new_tokens=24, ignore_eos=True, prompt_lookup_num_tokens=4)
        for a, b in zip(got, want):
            same(a, b)
            assert a.timings.batch_size == 2  # the rows ran together, each verifying its own drafts
        texts = ["", ""]
        finished = [None, None]
        for ev in eng.stream_batch(prompts, max_new_tokens=24, ignore_eos=True, prompt_lookup_num_tokens=4):
            assert finished[ev.index] is None  # nothing after a row's last event
            texts[ev.index] += ev.text
            finished[ev.index] = ev.finish_reason
        assert texts == [r.text for r in want] and finished == ["length", "length"]
        assert "".join(eng.stream(REPEAT, max_new_tokens=24, ignore_eos=True, prompt_lookup_num_tokens=3)) == \
            want[0].text


def test_should_stop_ends_every_row(tiny_engine):
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 2

    with trtinfer.load(tiny_engine("llama")) as eng:
        got = eng.generate([REPEAT, PLAIN], max_new_tokens=30, ignore_eos=True, prompt_lookup_num_tokens=4,
                           should_stop=stop)
        full = eng.generate([REPEAT, PLAIN], max_new_tokens=30, ignore_eos=True)
    assert [r.finish_reason for r in got] == ["cancelled", "cancelled"]
    # asked once per step: the rows ran together and both end at the second token
    assert [len(r.token_ids) for r in got] == [2, 2]
    for a, b in zip(got, full):
        assert a.token_ids == b.token_ids[:len(a.token_ids)]


def test_refusals(tiny_engine):
    with pytest.raises(ConfigError, match="prompt_lookup_num_tokens must be a positive integer"):
        GenerationConfig(prompt_lookup_num_tokens=0)
    with pytest.raises(ConfigError, match="does not combine with prompt_lookup_num_tokens"):
        GenerationConfig(prompt_lookup_num_tokens=3, num_beams=2)
    with pytest.raises(ConfigError, match="prompt_lookup_num_tokens does not combine with num_return_sequences"):
        GenerationConfig(prompt_lookup_num_tokens=3, do_sample=True, num_return_sequences=2)
    with trtinfer.load(tiny_engine("llama", disable_passes=("logits_positions",))) as eng:
        with pytest.raises(InputError, match="prompt_lookup_num_tokens needs logits at several positions") as e:
            eng.generate(["Hello"], prompt_lookup_num_tokens=3)
        assert "\n" not in str(e.value)


def test_logprobs_per_token_are_plain_logprobs(runner):
    """Greedy with logprobs: each kept position's own logits (a several-token pass) give plain decoding's numbers."""
    prompt = runner.ids(REPEAT)
    want = runner.plain([prompt], max_new_tokens=20, ignore_eos=True, logprobs=True)[0]
    (got,), (stats,) = runner.lookup([prompt], 4, max_new_tokens=20, ignore_eos=True, logprobs=True)
    same(got, want)
    assert stats.accepted > 0
    np.testing.assert_allclose([x.logprob for x in got.logprobs or []], [x.logprob for x in want.logprobs or []],
                               atol=1e-4)


PASSAGE = ("The lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper "
           "climbed the spiral stairs, trimmed the wick, and polished the great lens until it shone.")


@pytest.mark.slow
def test_smollm2_repeats_a_passage_with_accepted_drafts(real_engine):
    engine = real_engine("smollm2-135m")
    chat = [[{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{PASSAGE}"}]]
    with trtinfer.load(engine) as eng:
        want = eng.generate(chat, chat=True, max_new_tokens=48)[0]
        same(eng.generate(chat, chat=True, max_new_tokens=48, prompt_lookup_num_tokens=5)[0], want)
        cfg = dataclasses.replace(eng.generation_defaults, max_new_tokens=48, prompt_lookup_num_tokens=5)
        got = Generation(eng, [eng.tokenizer.encode_chat(chat[0])], cfg).run()[0]
    same(got, want)
    assert "lighthouse stood at the edge" in got.text
    assert got.accepted_tokens > 20 and got.draft_tokens - got.accepted_tokens < len(got.token_ids) // 2


def test_draft_counters_agree_when_a_verification_fails(tiny_engine):
    """A hook that raises while a draft is verified ends that request; the scheduler's draft and accepted counters
    (``/metrics``' ``spec_decode_*``) still count what the request counted (they skipped it before: 3 against 6)."""
    from trtinfer.runtime.scheduler import Scheduler

    prompt = np.random.default_rng(1).integers(3, 300, size=6).tolist() * 4  # repeats: the lookup drafts at once
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True, prompt_lookup_num_tokens=3)
    failed = 0
    with trtinfer.load(tiny_engine("llama")) as eng:
        for fail_at in range(2, 9):
            calls = []

            def hook(ids, scores, calls=calls, fail_at=fail_at):
                calls.append(1)
                if len(calls) == fail_at:
                    raise RuntimeError("the hook fails")
                return scores

            sched = Scheduler(eng, max_slots=1)
            req = sched.submit(prompt, cfg, logits_processor=hook)
            while sched.step():
                pass
            failed += req.error is not None
            stats = sched.stats()
            assert (stats["spec_decode_draft_tokens"], stats["spec_decode_accepted_tokens"]) == \
                (req.drafted, req.accepted)
            sched.close()
    assert failed == 7
