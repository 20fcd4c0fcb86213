"""The step budget: a prefill call's cost fitted as fixed + per token, and a step's prefill bounded in time while
others decode (the first call always runs, later ones only if they fit), by tokens alone otherwise."""
from __future__ import annotations

import numpy as np
import pytest

import trtinfer
from tests.runtime.test_scheduler import alone, run_all, same
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.scheduler import Scheduler
from trtinfer.runtime.step_budget import MIN_TOKENS, StepBudget


def measured(fixed: float, per_token: float, decode: float, sizes=(5, 12, 40, 7, 23, 64)) -> StepBudget:
    b = StepBudget(cap=256)
    for n in sizes:
        b.prefill_took(n, fixed + per_token * n)
        b.decode_took(decode)
    return b


def test_the_fit_recovers_a_calls_fixed_and_per_token_cost():
    fixed, per_token = measured(0.035, 0.0007, 0.045).cost()
    assert fixed == pytest.approx(0.035, rel=1e-6) and per_token == pytest.approx(0.0007, rel=1e-6)
    one_size = StepBudget(cap=256)
    for _ in range(4):
        one_size.prefill_took(16, 0.05)
    assert one_size.cost() is None  # no line through one size
    assert one_size.plan(decoding=True).room(300) == 256  # unknown costs: the token cap


def test_cpu_costs_allow_one_call_a_step_while_decoding():
    """SmolLM2 fp32 on 2 cores, roughly: a call's fixed cost is most of a decode step."""
    plan = measured(0.035, 0.0007, 0.045).plan(decoding=True)
    assert plan.room(40) == 40  # a whole short remainder
    assert plan.room(400) in (49, 50)  # 14 fit in time, but a call spends at least its fixed cost on tokens
    plan.spend(50)
    assert plan.room(5) == 0  # a second call would double the step again
    cheap_calls = measured(0.001, 0.0007, 0.045).plan(decoding=True)
    assert cheap_calls.room(400) in (62, 63)  # (45 - 1 ms) / 0.7 ms: the time bound
    assert MIN_TOKENS == 16 and measured(0.0, 0.01, 0.045).plan(decoding=True).room(400) == MIN_TOKENS


def test_gpu_like_costs_give_long_chunks_and_nobody_decoding_gives_the_cap():
    b = measured(0.005, 0.00001, 0.006)  # a call's launch cost ~ a decode step, tokens nearly free
    plan = b.plan(decoding=True)
    assert plan.room(1000) == 256  # a call's fixed cost is worth 500 tokens: chunks as long as the cap
    assert b.plan(decoding=False).room(1000) == 256
    cheap = measured(0.001, 0.0001, 0.04).plan(decoding=True)
    assert cheap.room(300) == 256  # the cap bounds time-rich steps too
    cheap.spend(100)
    assert cheap.room(50) == 50 and cheap.room(200) == 156


class PinnedCosts(StepBudget):
    """A budget whose costs are given, not measured: the step plans of a slow machine, on the tiny engine."""

    def prefill_took(self, tokens: int, seconds: float) -> None:
        pass

    def decode_took(self, seconds: float) -> None:
        pass


def test_while_a_request_decodes_each_step_makes_one_bounded_prefill_call(tiny_engine):
    rng = np.random.default_rng(3)
    first = rng.integers(3, 300, size=5).tolist()
    later = [rng.integers(3, 300, size=n).tolist() for n in (40, 25, 33)]
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    with trtinfer.load(tiny_engine("llama")) as eng:
        sched = Scheduler(eng, max_slots=4, prefix_caching=False)
        sched.budget = PinnedCosts(sched.prefill_chunk)
        for n in (5, 12, 40, 7):  # 10 ms a call + 0.7 ms a token, 45 ms a decode step
            StepBudget.prefill_took(sched.budget, n, 0.010 + 0.0007 * n)
        StepBudget.decode_took(sched.budget, 0.045)
        calls: list[list[int]] = []
        one, rows = sched.cache.prefill, sched.cache.prefill_rows

        def spy_one(slot, tokens):
            calls[-1].append(len(tokens))
            return one(slot, tokens)

        def spy_rows(first_row, prompts):
            calls[-1].append(len(prompts) * max(map(len, prompts)))
            return rows(first_row, prompts)

        sched.cache.prefill, sched.cache.prefill_rows = spy_one, spy_rows
        a = sched.submit(first, cfg)
        calls.append([])
        sched.step()
        reqs = [sched.submit(p, cfg) for p in later]
        for _ in range(12):
            calls.append([])
            before = len(a.generated)
            sched.step()
            assert len(a.generated) == before + 1  # the decoding request moves every step
        # one call a step, oldest prompt first, 50 tokens at most ((45 - 10) / 0.7 ms; then no time for a second)
        assert calls[1:] == [[40], [25], [33], [], [], [], [], [], [], [], [], []]
        run_all(sched)
        sched.close()
        for req, p in zip([a, *reqs], [first, *later]):
            same(req.result(), alone(eng, p, cfg))
