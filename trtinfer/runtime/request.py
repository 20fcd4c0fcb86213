"""A request of the continuous batcher: its settings, its progress (owned by the scheduler's thread) and its
events, read by any thread (blocking iteration, ``async for`` over :meth:`Request.stream`, or :meth:`Request.result`).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from trtinfer.errors import InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.generator import (
    GenerationResult,
    LogitsProcessor,
    TokenLogprob,
    check_hooks,
    check_prompts,
    eos_ids,
)
from trtinfer.runtime.prefix_cache import MIN_REUSE
from trtinfer.runtime.proposers import AssistantProposer, NgramProposer, Proposer, check_assistant
from trtinfer.runtime.structured import Matcher
from trtinfer.runtime.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from trtinfer.runtime.slots import SlotCache


@dataclass(frozen=True)
class Event:
    """One step of a request: a token and the text it adds; ``finish_reason`` is set on the last event.

    ``token_id`` is None only on a last event without a token (a cancelled request). ``logprob``: with
    ``logprobs=True``, the token's :class:`TokenLogprob`. ``time``: ``time.perf_counter()`` when it was made.
    """

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    time: float = 0.0


_held = threading.local()  # per thread: the loops whose wake-up waits for the end of a wake_once() block


@contextlib.contextmanager
def wake_once() -> Iterator[None]:
    """Within this block, the event loops this thread's pushes would wake are woken once each, at its end: the
    scheduler records a step's tokens for all its requests inside one, so a loop reading 8 streams gets one
    wake-up a step, not 8 (each a write and a read of the loop's self-pipe: ~3% of the server's samples at 8 streams
    on 2 cores). Outside such a block a push wakes its loop at once."""
    if getattr(_held, "loops", None) is not None:  # nested: the outer block wakes them
        yield
        return
    loops: set[_LoopWaker] = set()
    _held.loops = loops
    try:
        yield
    finally:
        _held.loops = None
        for waker in loops:
            waker.schedule()


@dataclass(frozen=True)
class Finished:
    """A request that ended finished or cancelled, as metrics count it (the scheduler's ``on_finish`` hook): its
    finish reason, prompt length and timestamps (``time.perf_counter()``). A request served as several internal ones
    (beam search's steps) is reported once, by what drives them (:meth:`Scheduler.report`)."""

    reason: str
    prompt_tokens: int
    t_submit: float
    t_first_token: float | None
    token_times: tuple[float, ...]
    t_end: float


class _LoopWaker:
    """Wakes an event loop's streams from other threads: the streams with news are collected and ONE
    ``call_soon_threadsafe`` sets them all (at once, or at the end of the pushing thread's :func:`wake_once`)."""

    _loops: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]] = weakref.WeakKeyDictionary()
    _loops_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: set[asyncio.Event] = set()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopWaker:
        with cls._loops_lock:
            waker = cls._loops.get(loop)
            if waker is None:  # made once per loop (setdefault would build one per call)
                waker = cls._loops[loop] = cls(loop)
            return waker

    def wake(self, event: asyncio.Event) -> None:
        """From any thread: ``event`` is set on the loop with the others pending, by one callback (already scheduled
        or held when others are pending)."""
        with self.lock:
            first = not self.pending
            self.pending.add(event)
        held = getattr(_held, "loops", None)
        if first and held is not None:
            held.add(self)
        elif first:
            self.schedule()

    def schedule(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop closed while the request ran: nobody listens any more
            with self.lock:
                self.pending.clear()

    def _flush(self) -> None:
        with self.lock:
            events, self.pending = self.pending, set()
        for event in events:
            event.set()


class Request:
    """One submitted prompt: its settings, its progress (owned by the scheduler) and its events (for any thread).

    Read it with blocking iteration (``for ev in request``), ``async for ev in request.stream()`` or
    :meth:`result`; a request that failed raises its error from all three. Timestamps (``time.perf_counter()``):
    ``t_submit``, ``t_admit`` (slot taken), ``t_first_token`` and ``token_times`` (one per token), for TTFT and
    inter-token latency. ``cfg.max_time`` counts from ``t_submit``. Nothing cancels a request whose reader went away
    (an HTTP client that disconnected): call :meth:`cancel` then, or it runs to its end.
    """

    def __init__(self, prompt_ids: list[int], cfg: GenerationConfig, eos: tuple[int, ...],
                 decoder: IncrementalDecoder | None, matcher: Matcher | None = None, *,
                 seed: np.random.SeedSequence | None = None, proposer: Proposer | None = None,
                 logits_processor: LogitsProcessor | None = None, keep_logits: bool = False,
                 min_reuse: int = MIN_REUSE, decode_tail: bool = False, internal: bool = False) -> None:
        self.id = -1  # set when it queues (arrival order)
        self.prompt_ids, self.cfg = prompt_ids, cfg
        self.t_submit = time.perf_counter()
        self.t_admit: float | None = None
        self.t_first_token: float | None = None
        self.token_times: list[float] = []
        # --- progress, touched by the scheduler's thread only -----------------------------------------------------
        self.slot: int | None = None
        self.num_computed = 0  # prompt tokens in the slot's KV
        self.generated: list[int] = []
        self.next_token: int | None = None  # sampled, not yet fed back
        self.eos = eos
        self._seen = np.asarray(prompt_ids, dtype=np.int64)
        self._decoder = decoder  # None: no text until the end (no stream, no stop strings), decoded once then
        self._logprobs: list[TokenLogprob] | None = [] if cfg.logprobs else None
        if seed is None:
            seed = np.random.SeedSequence(cfg.seed).spawn(1)[0]
        self._rng = np.random.default_rng(seed) if cfg.do_sample else None
        self._deadline = None if cfg.max_time is None else self.t_submit + cfg.max_time
        #: ``should_stop(k) -> bool`` (engine.generate's hook): asked as the request's k-th new token is recorded;
        #: True ends it there with ``"cancelled"``
        self.should_stop: Callable[[int], bool] | None = None
        # speculative decoding: drafts verified by the scheduler (vLLM's ngram method, or an assistant engine)
        self.proposer = proposer
        self.drafted = self.accepted = 0  # draft tokens proposed / kept
        self.matcher = matcher  # the response_format's grammar state (structured outputs)
        self.logits_processor = logits_processor  # the user's hook, run on this request's logits
        #: a part of a larger request (a beam search step): not counted, nor reported to ``on_finish``, by itself
        self.internal = internal
        #: with ``keep_logits``, the raw logits ``[V]`` the last token was chosen from (beam search reads them)
        self.keep_logits = keep_logits
        self.min_reuse = min_reuse  # the shortest cached prefix this request takes
        self.decode_tail = decode_tail  # its prompt's last token may be fed alone in a decode call
        self.last_logits: np.ndarray | None = None
        self._batch_size = 1
        # --- shared with readers -----------------------------------------------------------------------------------
        self._cond = threading.Condition()
        self._events: list[Event] = []
        self._wakers: list[Callable[[], None]] = []
        self._done = self._cancelled = False
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"Request(id={self.id}, prompt={len(self.prompt_ids)} tokens, slot={self.slot}, done={self._done})"

    @property
    def done(self) -> bool:
        """True once the last event was pushed (finished, cancelled or failed)."""
        with self._cond:
            return self._done

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        with self._cond:
            return self._cancelled

    def cancel(self) -> None:
        """Stop this request: it ends with ``finish_reason="cancelled"`` and its slot frees at the next step."""
        with self._cond:
            self._cancelled = True

    # --- reading ------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Event]:
        """Events as they come (blocking); raises the request's error after its last event, if it failed."""
        i = 0
        while True:
            with self._cond:
                while len(self._events) <= i and not self._done:
                    self._cond.wait()
                batch, done = self._events[i:], self._done  # nothing is pushed after the end: done means all read
            i += len(batch)
            yield from batch
            if done:
                self._raise_error()
                return

    async def stream(self) -> AsyncIterator[Event]:
        """Events as they come, for asyncio: the scheduler's thread wakes this loop through
        ``call_soon_threadsafe`` (once for all of a loop's streams with news, :class:`_LoopWaker`); raises the
        request's error after its last event, if it failed."""
        wake = asyncio.Event()
        waker = partial(_LoopWaker.of(asyncio.get_running_loop()).wake, wake)
        with self._cond:
            self._wakers.append(waker)
        i = 0
        try:
            while True:
                wake.clear()  # before reading: an event pushed after the read sets it again
                with self._cond:
                    batch, done = self._events[i:], self._done
                i += len(batch)
                for ev in batch:
                    yield ev
                if done:
                    self._raise_error()
                    return
                if not batch:
                    await wake.wait()
        finally:
            with self._cond:
                self._wakers.remove(waker)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the end; the :class:`GenerationResult` (raises the request's error if it failed, TimeoutError
        after ``timeout`` seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        self._raise_error()
        assert self._result is not None
        return self._result

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def events_since(self, i: int) -> list[Event]:
        """The events from the ``i``-th on, as pushed so far (no waiting: for the thread that steps the scheduler)."""
        with self._cond:
            return self._events[i:]

    @property
    def error(self) -> BaseException | None:
        """The error a failed request ended with (None otherwise)."""
        with self._cond:
            return self._error

    # --- writing (the scheduler) --------------------------------------------------------------------------------
    def _push(self, event: Event | None, result: GenerationResult | None = None,
              error: BaseException | None = None) -> None:
        """Append ``event`` (None: none) and, with a result or an error, end the request; wake its readers."""
        with self._cond:
            if self._done:
                return
            if event is not None:
                self._events.append(event)
            if result is not None or error is not None:
                self._result, self._error, self._done = result, error, True
            self._cond.notify_all()
            wakers = list(self._wakers)
        for w in wakers:
            w()


def new_request(engine: Any, cache: SlotCache, max_seq_len: int, prompt_ids: Sequence[int],
                cfg: GenerationConfig | None, *, clip: bool = False, seed: np.random.SeedSequence | None = None,
                logits_processor: LogitsProcessor | None = None, assistant: Any = None, text: bool = True,
                keep_logits: bool = False, min_reuse: int = MIN_REUSE, decode_tail: bool = False,
                internal: bool = False) -> Request:
    """A checked request for ``engine`` (rows of ``cache``, ``max_seq_len`` positions each), not queued yet (its id
    is set when it queues); the options are :meth:`~trtinfer.runtime.scheduler.Scheduler.submit`'s."""
    cfg = engine.generation_defaults if cfg is None else cfg
    if not isinstance(cfg, GenerationConfig):
        raise InputError(f"cfg must be a GenerationConfig, got {type(cfg).__name__}")
    if cfg.num_beams > 1 or cfg.num_return_sequences > 1:
        raise InputError("the scheduler runs one sequence per request without beam search (num_beams=1, "
                         "num_return_sequences=1: submit the request n times for n sequences); beam search is "
                         "trtinfer.runtime.beam.beam_search over a scheduler")
    tokenizer, vocab = engine.tokenizer, int(engine.manifest.geometry["vocab_size"])
    ids = check_prompts([prompt_ids], vocab, max_seq_len)[0]
    if not clip and len(ids) + cfg.max_new_tokens > max_seq_len:
        raise InputError(f"a prompt of {len(ids)} tokens + max_new_tokens {cfg.max_new_tokens} = "
                         f"{len(ids) + cfg.max_new_tokens} exceeds the model length {max_seq_len}; shorten the "
                         "prompt or ask for fewer tokens")
    eos = eos_ids(cfg, tokenizer, vocab)
    check_hooks(logits_processor, None)
    # a response_format's grammar, compiled before the request queues (a bad schema is the caller's 400)
    matcher = None if cfg.response_format is None else tokenizer.grammars(vocab).matcher(cfg.response_format)
    if assistant is not None and cfg.prompt_lookup_num_tokens is not None:
        raise InputError("assistant and prompt_lookup_num_tokens are two ways of drafting; give one of them")
    drafting = ("assistant" if assistant is not None else
                "prompt_lookup_num_tokens" if cfg.prompt_lookup_num_tokens is not None else None)
    if drafting and not cache.every_position:
        raise InputError(f"{drafting} needs logits at several positions per pass, but this engine's graph computes "
                         "them at the last position only (no logits_positions input: an older trtinfer build or "
                         f"that pass disabled); rebuild the engine, or generate without {drafting}")
    if assistant is not None:
        check_assistant(assistant, tokenizer, vocab)
    decoder = IncrementalDecoder(tokenizer, cfg.stop) if text or cfg.stop else None
    proposer: Proposer | None = (
        AssistantProposer(assistant, cfg, eos, min(cache.capacity, len(ids) + cfg.max_new_tokens + 1))
        if assistant is not None else NgramProposer(cfg) if cfg.prompt_lookup_num_tokens is not None else None)
    return Request(ids, cfg, eos, decoder, matcher, seed=seed, proposer=proposer, logits_processor=logits_processor,
                   keep_logits=keep_logits, min_reuse=min_reuse, decode_tail=decode_tail, internal=internal)
