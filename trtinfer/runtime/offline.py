"""``engine.generate`` / ``stream`` / ``stream_batch``: the scheduler (:mod:`trtinfer.runtime.scheduler`) sized for one
call's rows and stepped in the caller's thread.

There is one decode loop in the runtime: the scheduler's ``step()``. An offline generation submits its rows (each its
own request; sample ``j`` of a prompt seeded as the server seeds choice ``j``, :meth:`GenerationConfig.for_sample`,
whatever else is in the batch) to a scheduler with a slot per row and KV room for the
longest prompt plus ``max_new_tokens``, without prefix caching, and steps it until every row ends. So a row's output is
what the server returns for the same prompt and seed, and every feature of the loop (sampling, stop rules, logprobs,
response formats, prompt lookup, assisted decoding) is the same code in both.

Every row's length is its own: a row finishes with ``"length"`` when its prompt + generated tokens reach the engine's
``max_seq_len``, so a short prompt next to a long one may generate more than ``max_seq_len - longest`` tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from typing import Any

from trtinfer.errors import InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.generator import GenerationResult, LogitsProcessor, StreamEvent, check_hooks, check_prompts
from trtinfer.runtime.request import Request
from trtinfer.runtime.scheduler import Scheduler


def _scheduler(engine: Any, prompts: list[list[int]], slots: int, max_new_tokens: int, **options: Any) -> Scheduler:
    """A scheduler for one call's rows, stepped in the caller's thread: ``slots`` rows, KV room for every token a row
    may feed (its last is never fed), every prompt prefilled in the first step (one call for neighbouring fresh
    rows)."""
    longest = max(map(len, prompts))
    return Scheduler(engine, max_queue=slots, max_slots=slots, prefill_chunk=slots * longest, reserve=False,
                     kv_capacity=min(int(engine.manifest.max_seq_len), longest + max_new_tokens + 1), **options)


class _Stopper:
    """``should_stop()`` asked once per generation step, whichever row reaches that step first; True sticks."""

    def __init__(self, should_stop: Callable[[], bool]) -> None:
        self.fn, self.asked, self.stopped = should_stop, 0, False

    def __call__(self, k: int) -> bool:
        while not self.stopped and self.asked < k:
            self.asked += 1
            self.stopped = bool(self.fn())
        return self.stopped


class Generation:
    """One batched generation of an engine. Iterate :meth:`events` for streaming, or call :meth:`run`; read
    :attr:`results` after."""

    def __init__(self, engine: Any, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, *,
                 logits_processor: LogitsProcessor | None = None, should_stop: Callable[[], bool] | None = None,
                 assistant: Any = None, samples: int = 1) -> None:
        limit = int(engine.manifest.max_batch_size)
        if len(prompts) > limit:  # rows: prompts x num_return_sequences (engine.generate repeats each prompt)
            raise InputError(f"{len(prompts)} rows (prompts x num_return_sequences) exceed the engine's max batch "
                             f"size {limit}; split the batch, ask for fewer sequences, or rebuild with a larger "
                             "--max-batch-size")
        self.engine, self.cfg, self.assistant, self.samples = engine, cfg, assistant, samples  # rows: prompt x sample
        self.prompts = check_prompts(prompts, int(engine.manifest.geometry["vocab_size"]),
                                     int(engine.manifest.max_seq_len))
        self.logits_processor, self.should_stop = check_hooks(logits_processor, should_stop)
        self.results: list[GenerationResult] = []

    def events(self) -> Iterator[StreamEvent]:
        """Run the generation, yielding each row's text deltas as tokens arrive; fills :attr:`results`."""
        return self._steps(text=True)

    def run(self) -> list[GenerationResult]:
        """Run the generation without streaming: without stop strings, each row is detokenized once, at its end."""
        for _ in self._steps(text=False):
            pass
        return self.results

    def _steps(self, text: bool) -> Iterator[StreamEvent]:
        cfg, prompts = self.cfg, self.prompts
        with closing(_scheduler(self.engine, prompts, len(prompts), cfg.max_new_tokens, prefix_caching=False)) as sched:
            stopper = None if self.should_stop is None else _Stopper(self.should_stop)
            reqs = [sched.submit(p, cfg.for_sample(i % self.samples), clip=True, logits_processor=self.logits_processor,
                                 assistant=self.assistant, text=text) for i, p in enumerate(prompts)]
            for req in reqs:
                req.should_stop = stopper
            read = [0] * len(reqs)
            while sched.step():
                yield from self._drain(reqs, read, text)
            yield from self._drain(reqs, read, text)
            self.results = [r.result() for r in reqs]

    @staticmethod
    def _drain(reqs: list[Request], read: list[int], text: bool) -> Iterator[StreamEvent]:
        """Each row's new events (raising a failed row's error as the caller's)."""
        for i, req in enumerate(reqs):
            new = req.events_since(read[i])
            read[i] += len(new)
            if text:
                yield from (StreamEvent(i, ev.text, ev.token_id, ev.finish_reason) for ev in new)
            err = req.error
            if err is not None:  # the scheduler wraps a request's failure: the cause is the caller's (their hook's)
                raise err.__cause__ or err


class BeamGeneration:
    """``engine.generate(num_beams=...)``: :class:`~trtinfer.runtime.beam.BeamSearch` over a scheduler with a row
    per beam (prefix caching on: each beam's KV stays in its row), stepped in the caller's thread."""

    def __init__(self, engine: Any, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, *,
                 logits_processor: LogitsProcessor | None = None,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.engine, self.cfg = engine, cfg
        self.prompts = check_prompts(prompts, int(engine.manifest.geometry["vocab_size"]),
                                     int(engine.manifest.max_seq_len))
        self.logits_processor, self.should_stop = logits_processor, should_stop

    def run(self) -> list[GenerationResult]:
        from trtinfer.runtime.beam import BeamSearch

        limit = int(self.engine.manifest.max_batch_size)
        if self.cfg.num_beams > limit:
            raise InputError(f"num_beams={self.cfg.num_beams} exceeds the engine's max batch size {limit} (each beam "
                             "is a row of the batch); lower num_beams or rebuild with a larger --max-batch-size")
        slots = min(limit, self.cfg.num_beams * len(self.prompts))
        with closing(_scheduler(self.engine, self.prompts, slots, self.cfg.max_new_tokens)) as sched:
            return BeamSearch(sched, self.prompts, self.cfg, drive=True, logits_processor=self.logits_processor,
                              should_stop=self.should_stop).run()
