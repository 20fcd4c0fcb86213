"""Automatic prefix caching: a request reuses the KV of the longest prefix a row holds, and its output is the same
as without it (greedy and seeded sampling), whether the row was free (taken in place) or running (copied)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import trtinfer
from tests.runtime.test_scheduler import GREEDY, alone, answers_equal_alone, record_prefills, run_all, same
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.prefix_cache import MIN_REUSE, PrefixIndex
from trtinfer.runtime.scheduler import Scheduler

SAMPLED = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request, tiny_engine):
    with trtinfer.load(tiny_engine(request.param)) as eng:
        yield eng


def _texts(seed: int, system: int = 40, suffixes: tuple[int, ...] = (5, 9, 3)) -> list[list[int]]:
    """Prompts sharing a ``system``-token prefix, each with its own suffix."""
    rng = np.random.default_rng(seed)
    head = rng.integers(3, 300, size=system).tolist()
    return [head + rng.integers(3, 300, size=n).tolist() for n in suffixes]


def test_index_longest_prefix_and_lru():
    idx = PrefixIndex(3)
    idx.extend(0, [1, 2, 3, 4], prompt=True)
    idx.extend(1, [1, 2, 9], prompt=True)
    assert idx.longest([1, 2, 3, 5], [0, 1, 2]) == (0, 3)
    assert idx.longest([1, 2, 9, 9], [0, 1, 2]) == (1, 3)
    assert idx.longest([7, 7], [0, 1, 2]) == (None, 0)
    assert idx.longest([1, 2, 3], [1, 2]) == (1, 2)  # only the rows asked about
    assert idx.least_recent([0, 1, 2]) == 2  # never used
    idx.extend(2, [5])
    assert idx.least_recent([0, 1, 2]) == 0
    idx.cut(0, 1)
    assert idx.tokens[0] == [1] and idx.least_recent([0, 1, 2]) == 1


def test_index_reuses_only_what_a_prompts_prefill_computed():
    """Tokens fed one a pass (decode steps) or after them, and one-token passes, are held but not reused by a new
    prompt (they may round differently from a prompt's chunk); ``decoded=True`` (beam continuations) takes them."""
    idx = PrefixIndex(2)
    idx.extend(0, [1, 2, 3], prompt=True)
    idx.extend(0, [4])  # a decode step
    idx.extend(0, [5, 6], prompt=True)  # a chunk after a decoded token: its KV depends on that token's
    assert idx.tokens[0] == [1, 2, 3, 4, 5, 6] and idx.prefilled[0] == 3
    assert idx.longest([1, 2, 3, 4, 5, 6, 7], [0, 1]) == (0, 3)
    assert idx.longest([1, 2, 3, 4, 5, 6, 7], [0, 1], decoded=True) == (0, 6)
    idx.extend(1, [1], prompt=True)  # a one-token prompt pass
    assert idx.prefilled[1] == 0
    idx.cut(0, 2)
    assert idx.prefilled[0] == 2 and idx.longest([1, 2, 3], [0]) == (0, 2)


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_a_later_request_reuses_a_finished_rows_prefix_and_answers_the_same(engine, cfg):
    first, second, _ = _texts(1)
    with Scheduler(engine, max_slots=2) as sched:
        a = sched.submit(first, cfg).result(timeout=60)
        before = sched.stats()
        b = sched.submit(second, cfg).result(timeout=60)
        after = sched.stats()
    same(a, alone(engine, first, cfg))
    same(b, alone(engine, second, cfg))
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits == 40  # the shared system prompt, found in the finished row
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(second)  # counted whole, as vLLM counts them


def test_prefix_is_copied_from_a_running_row(engine):
    """B arrives while A decodes: A's row is busy, so B gets a copy of its prefix in a free row."""
    first, second, third = _texts(2)
    long = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    sched = Scheduler(engine, max_slots=3)
    a = sched.submit(first, long)
    for _ in range(4):
        sched.step()
    assert a.next_token is not None  # decoding
    b, c = sched.submit(second, GREEDY), sched.submit(third, GREEDY)
    run_all(sched)
    stats = sched.stats()
    sched.close()
    same(a.result(), alone(engine, first, long))
    same(b.result(), alone(engine, second, GREEDY))
    same(c.result(), alone(engine, third, GREEDY))
    assert stats["prefix_cache_hits"] >= 2 * 40
    assert {a.slot, b.slot, c.slot} == {None}


def test_a_conversation_reuses_the_earlier_turns_prompt_not_its_decoded_answer(engine):
    """Turn 2's prompt = turn 1's prompt + its answer + more, straight after turn 1 (stepped by the caller: no idle
    loop): the first prompt's KV is reused; the answer's, decoded one token a pass, is prefilled again as a prompt's
    chunk (a one-token pass may round differently)."""
    first = _texts(3)[0]
    sched = Scheduler(engine, max_slots=2)
    r1 = sched.submit(first, GREEDY)
    run_all(sched)
    turn2 = first + r1.result().token_ids + [5, 6, 7, 8]
    r2 = sched.submit(turn2, GREEDY)
    run_all(sched)
    hits = sched.stats()["prefix_cache_hits"]
    sched.close()
    same(r2.result(), alone(engine, turn2, GREEDY))
    assert hits == len(first)


def test_an_idle_scheduler_makes_a_finished_answer_reusable(engine):
    """With nothing to run, the scheduler's loop recomputes the finished answer's KV as a prompt chunk computes it
    (8 tokens a call here): the next turn then reuses all of turn 1 (the fed-back answer tokens) and answers the
    same as its prompt alone."""
    first = _texts(3)[0]
    cfg = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    with Scheduler(engine, max_slots=2, prefill_chunk=8) as sched:
        r1 = sched.submit(first, cfg).result(timeout=60)
        index = sched.cache.index
        row = next(r for r, held in enumerate(index.tokens) if held[:len(first)] == first)
        fed = len(first) + len(r1.token_ids) - 1  # the last answer token is never fed back
        deadline = time.monotonic() + 60
        while index.prefilled[row] < fed:
            assert time.monotonic() < deadline, "the idle scheduler did not refill the answer"
            time.sleep(0.01)
        assert index.tokens[row] == first + r1.token_ids[:-1]
        turn2 = first + r1.token_ids + [5, 6, 7, 8]
        before = sched.stats()["prefix_cache_hits"]
        r2 = sched.submit(turn2, GREEDY).result(timeout=60)
        hits = sched.stats()["prefix_cache_hits"] - before
    same(r2, alone(engine, turn2, GREEDY))
    assert hits == fed


def test_a_failed_refill_drops_the_answer_and_the_loop_goes_on(engine, caplog):
    """The idle recompute of a finished answer fails (injected): its decoded tokens are dropped from the row (kept
    up to the prefilled prompt), it is not tried again, and the next request is served and answers the same."""
    first, second, _ = _texts(1)
    with Scheduler(engine, max_slots=2) as sched:
        calls = []

        def broken(row, limit):
            calls.append(row)
            raise RuntimeError("injected")

        sched.cache.refill = broken
        r1 = sched.submit(first, GREEDY).result(timeout=60)
        index = sched.cache.index
        row = next(r for r, held in enumerate(index.tokens) if held[:len(first)] == first)
        deadline = time.monotonic() + 60
        while len(index.tokens[row]) > len(first):
            assert time.monotonic() < deadline, "the failed row was not cut to its prompt"
            time.sleep(0.01)
        time.sleep(0.2)  # a loop that retried would call it again by now
        assert calls == [row] and index.tokens[row] == first and index.prefilled[row] == len(first)
        b = sched.submit(second, GREEDY).result(timeout=60)
    same(r1, alone(engine, first, GREEDY))
    same(b, alone(engine, second, GREEDY))
    assert "it will not be reused" in caplog.text


def test_no_prefix_caching_prefills_everything_and_answers_the_same(engine):
    first, second, _ = _texts(4)
    with Scheduler(engine, max_slots=2, prefix_caching=False) as sched:
        a = sched.submit(first, GREEDY).result(timeout=60)
        b = sched.submit(second, GREEDY).result(timeout=60)
        stats = sched.stats()
    same(a, alone(engine, first, GREEDY))
    same(b, alone(engine, second, GREEDY))
    assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_queries"] == 0
    assert stats["prompt_tokens"] == len(first) + len(second)


def test_short_matches_are_not_reused_and_lru_rows_are_evicted(engine):
    """Two slots, three different prefixes in turn: the least recently used row is evicted; a match shorter than
    MIN_REUSE (a shared first token) does not take a row."""
    rng = np.random.default_rng(5)
    a, b, c = ([1] + rng.integers(3, 300, size=30).tolist() for _ in range(3))
    with Scheduler(engine, max_slots=2) as sched:
        for p in (a, b):
            sched.submit(p, GREEDY).result(timeout=60)
        rows = [list(t) for t in sched.cache.index.tokens]
        assert any(r[:31] == a for r in rows) and any(r[:31] == b for r in rows)
        sched.submit(c, GREEDY).result(timeout=60)  # evicts a's row (least recently used)
        rows = [list(t) for t in sched.cache.index.tokens]
        assert not any(r[:31] == a for r in rows) and any(r[:31] == b for r in rows)
        again = b[:MIN_REUSE + 4] + [7, 8]
        before = sched.stats()["prefix_cache_hits"]
        got = sched.submit(again, GREEDY).result(timeout=60)
        assert sched.stats()["prefix_cache_hits"] - before == MIN_REUSE + 4
    same(got, alone(engine, again, GREEDY))


@pytest.mark.parametrize("caching", [True, False])
def test_server_reports_prefix_hits_and_answers_the_same(tiny_engine, caching):
    """A live server: two completions sharing a long prompt prefix; /metrics counts the reused tokens (none with
    --no-prefix-caching), and the answers equal generate's either way."""
    import httpx
    import openai

    from tests.serving.test_server import Live, metric
    from trtinfer.serving.app import create_app
    from trtinfer.serving.config import ServeConfig

    engine_dir = tiny_engine("llama")
    first, second, _ = _texts(6)
    server = Live(create_app(engine_dir, ServeConfig(port=0, prefix_caching=caching)))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        got = [client.completions.create(model="engine", prompt=p, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in (first, second)]
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    with trtinfer.load(engine_dir) as ref:
        want = [r.text for r in ref.generate(input_ids=[first, second], max_new_tokens=6, ignore_eos=True)]
    assert got == want
    assert metric(text, "trtinfer:prefix_cache_hits_total") == (40 if caching else 0)
    assert metric(text, "trtinfer:prefix_cache_queries_total") == (len(first) + len(second) if caching else 0)


def test_cli_flag_turns_prefix_caching_off():
    import argparse

    from trtinfer.cli import serve as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    assert serve_cli.config_from_args(parser.parse_args(["serve", "e"])).prefix_caching is True
    assert serve_cli.config_from_args(parser.parse_args(["serve", "e", "--no-prefix-caching"])).prefix_caching is False


@pytest.mark.parametrize("chunk", [256, 40])
def test_new_prompts_in_neighbouring_rows_prefill_as_one_call(engine, chunk):
    """Three new ragged prompts: with room in the step's budget they prefill in ONE batched call (no batch-1
    chunks); with a budget smaller than rows x the longest they go in chunks. Outputs equal generate alone."""
    rng = np.random.default_rng(8)
    ps = [rng.integers(3, 300, size=n).tolist() for n in (11, 4, 17)]
    sched = Scheduler(engine, max_slots=3, prefill_chunk=chunk)
    calls = record_prefills(sched)
    answers_equal_alone(engine, sched, ps)
    if chunk == 256:
        assert calls == {"rows": [[11, 4, 17]], "chunk": []}
    else:  # 2 x 11 fits 40, then 17 alone (a run of one is a chunk)
        assert calls["rows"] == [[11, 4]] and sum(calls["chunk"]) == 17


def test_a_one_token_prompt_is_never_a_row_of_a_batched_prefill(engine):
    """A one-token prompt alone is a one-token pass (the decoder graph); batched with longer new prompts it would be
    a row of a several-token pass (the int8 prefill graph where the engine has one, which changed SmolLM2 int4's
    answers). It prefills on its own; the others still share one call; outputs equal generate alone."""
    rng = np.random.default_rng(9)
    ps = [rng.integers(3, 300, size=n).tolist() for n in (6, 1, 5, 7)]
    sched = Scheduler(engine, max_slots=4)
    calls = record_prefills(sched)
    answers_equal_alone(engine, sched, ps)
    assert calls["rows"] == [[5, 7]] and 1 in calls["chunk"]  # 5 and 7 batched (neighbours); 1 and 6 on their own


def test_same_prompt_submitted_together_shares_one_prefill(engine):
    """n choices of one prompt (the server submits n requests): the first prefills, the others wait for its row and
    copy it, prefilling only the last two prompt tokens (a chunk, as a whole prompt ends); seeded outputs equal
    generate alone."""
    prompt = _texts(9, system=30, suffixes=(6,))[0]
    cfgs = [GenerationConfig(max_new_tokens=8, do_sample=True, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    with Scheduler(engine, max_slots=3) as sched:
        reqs = [sched.submit(prompt, c) for c in cfgs]
        got = [r.result(timeout=60) for r in reqs]
        stats = sched.stats()
    for r, c in zip(got, cfgs):
        same(r, alone(engine, prompt, c))
    assert stats["prefix_cache_hits"] == 2 * (len(prompt) - 2)  # all but the last two tokens (see Scheduler.submit)


def test_server_n_choices_share_one_prefill(tiny_engine):
    """``n=3`` through the openai client: one prefill, two copies (the metric counts them), three answers."""
    import httpx
    import openai

    from tests.serving.test_server import Live, metric
    from trtinfer.serving.app import create_app
    from trtinfer.serving.config import ServeConfig

    prompt = _texts(10, system=30, suffixes=(5,))[0]
    server = Live(create_app(tiny_engine("llama"), ServeConfig(port=0)))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        out = client.completions.create(model="engine", prompt=prompt, max_tokens=5, n=3, temperature=0.8, seed=5,
                                        extra_body={"ignore_eos": True})
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    assert len(out.choices) == 3 and out.usage.completion_tokens == 15
    assert metric(text, "trtinfer:prefix_cache_hits_total") == 2 * (len(prompt) - 2)


# --- prompt lookup (vLLM's ngram speculation) on the scheduler ------------------------------------------------------
def _repetitive(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    phrase = rng.integers(3, 300, size=6).tolist()
    return phrase * 5 + phrase[:3]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_ngram_drafts_are_verified_and_answer_as_plain_decoding(engine, sampled):
    """Requests with prompt_lookup_num_tokens draft from their own n-grams and verify in one pass: the tokens are
    plain decoding's (greedy, and seeded sampling with one draw per kept token), next to a plain request."""
    base = {"max_new_tokens": 16, "ignore_eos": True, "do_sample": sampled, "seed": 3 if sampled else None}
    plain, look = GenerationConfig(**base), GenerationConfig(**base, prompt_lookup_num_tokens=4)
    ps = [_repetitive(1), _repetitive(2)]
    with Scheduler(engine, max_slots=3) as sched:
        reqs = [sched.submit(ps[0], look), sched.submit(ps[1], look), sched.submit(ps[0], plain)]
        got = [r.result(timeout=60) for r in reqs]
    for r, p in zip(got, ps + ps[:1]):
        assert r.token_ids == alone(engine, p, plain).token_ids
    assert reqs[2].drafted == 0
    if not sampled:  # a greedy tiny model repeats its prompt's phrase: drafts are found (sampled ones may not be)
        assert all(r.drafted > 0 for r in reqs[:2])
    assert all(0 <= r.accepted <= r.drafted for r in reqs)


def test_server_speculative_ngram(tiny_engine):
    """--speculative-ngram 4: a live server's greedy answer to a repetitive prompt equals generate's, and the draft
    counters on /metrics move."""
    import httpx
    import openai

    from tests.serving.test_server import Live, metric
    from trtinfer.serving.app import create_app
    from trtinfer.serving.config import ServeConfig

    engine_dir = tiny_engine("llama")
    prompt = _repetitive(1)
    server = Live(create_app(engine_dir, ServeConfig(port=0, speculative_ngram=4)))
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="engine", prompt=prompt, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    with trtinfer.load(engine_dir) as ref:
        assert got == ref.generate(input_ids=[prompt], max_new_tokens=16, ignore_eos=True)[0].text
    drafted = metric(text, "trtinfer:spec_decode_num_draft_tokens_total")
    assert drafted > 0 and 0 <= metric(text, "trtinfer:spec_decode_num_accepted_tokens_total") <= drafted
