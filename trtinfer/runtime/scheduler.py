"""Continuous batching: requests join and leave between decode steps, each in its own slot of one KV cache.

::

    submit ──► waiting (bounded FIFO) ──► slot s (KV reserved up front) ──► prefill ──────────────► decode ──► retired
                 full: QueueFullError        the row holding its longest      new rows: one call     one batched call
                                             prefix, else least recently used rest: batch-1 chunks

Every :meth:`Scheduler.step` retires cancelled requests, admits waiting ones into free slots, prefills up to
``prefill_chunk`` prompt tokens (so a long prompt never stalls the running decodes for more than one chunk), in ONE
call while others are decoding, then runs ONE batched decode step for every request that is decoding. A slot is a
row of the session's slot KV cache (:class:`~trtinfer.runtime.slots.SlotCache`): a request is admitted only when its
prompt + ``max_new_tokens`` fits the engine's max sequence length, so it never runs out of room and nothing running
is ever evicted.

Automatic prefix caching (``prefix_caching``, on by default): a finished request's row keeps its KV, and a new
request starts from the longest prefix any row holds (:class:`~trtinfer.runtime.prefix_cache.PrefixIndex`): a free
row holding it is taken as it is, a running row's prefix is copied into a free row (on the session's device);
only the rest is prefilled, at least the prompt's last two tokens (see :meth:`Scheduler.submit`'s ``decode_tail``).
With no match of at least :data:`~trtinfer.runtime.prefix_cache.MIN_REUSE` tokens the least recently used free
row is evicted. A request sharing a prefix with one still prefilling it waits until it is in that row (``n``
choices of one prompt share one prefill). Only KV that a prompt's prefill computed is reused, not decoded tokens'
(a one-token pass may round differently); a started scheduler with nothing to run recomputes finished answers that
way, a chunk at a time (:meth:`Scheduler._refill`), so a conversation's next turn reuses its answer.

A request's tokens depend on its own prompt, settings and seed only: selection runs per request with its own
generator (``SeedSequence(seed).spawn(1)[0]``, as ``engine.generate`` seeds a batch of one), so its output equals
``engine.generate`` of that prompt alone, whatever it was batched with. Only the scheduler's thread touches the
session; :meth:`Scheduler.submit` and :meth:`Request.cancel` touch locked queues and flags only.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from trtinfer.errors import InputError, QueueFullError, ServingError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.emission import Emission
from trtinfer.runtime.generator import GenerationResult, Timings
from trtinfer.runtime.prefill_plan import chunk_size, fresh_runs, head, tail_due
from trtinfer.runtime.prefix_cache import common_prefix
from trtinfer.runtime.request import Event, Finished, Request, new_request
from trtinfer.runtime.slots import SlotCache

log = logging.getLogger(__name__)

#: tokens of a finished answer an idle scheduler recomputes per call (:meth:`Scheduler._refill`): a request that
#: arrives meanwhile waits for one such call (SmolLM2-135M int4 on 2 cores: ~40 ms)
REFILL_CHUNK = 32
#: seconds a scheduler stays idle before it recomputes finished answers: a request right behind the last one (a
#: client's next request under load) does not wait for a recompute; a conversation's next turn comes later
#: (8 closed-loop chat clients, SmolLM2 int4: TTFT p50 57-73 ms with no delay, 46-50 ms without recomputing)
REFILL_DELAY_S = 0.1


class Scheduler(Emission):
    """Continuous batching over an engine: :meth:`submit` requests from any thread; a background thread
    (:meth:`start`) or the caller (:meth:`step`) runs them. Use as a context manager (starts and closes).

    ``max_slots`` (default: the engine's max batch size) is how many requests run at once, each holding one row of
    a KV cache of ``max_model_len`` positions (default: the engine's max sequence length), reserved when the
    scheduler starts (CPU: ``slots * max_model_len * layers * 2 * kv_heads * head_dim * 4`` bytes, e.g. 754 MiB
    for SmolLM2-135M at 8 x 2048); up to ``max_queue`` more wait for a slot. A request needs prompt +
    ``max_new_tokens`` <= ``max_model_len``.

    ``on_finish(finished)`` (a :class:`~trtinfer.runtime.request.Finished`) runs on the stepping thread for every
    request that ends finished or cancelled (not one that fails, nor an ``internal`` one: a request served as several,
    beam search's, is reported once through :meth:`report`), before ``requests_finished`` counts it and before its
    reader sees the last event: what it records is in place once the count or the answer is.
    """

    def __init__(self, engine: Any, max_queue: int = 64, prefill_chunk: int = 256,
                 max_slots: int | None = None, max_model_len: int | None = None,
                 on_finish: Callable[[Finished], None] | None = None, prefix_caching: bool = True,
                 kv_capacity: int | None = None, reserve: bool = True) -> None:
        limit = int(engine.manifest.max_batch_size)
        slots = limit if max_slots is None else max_slots
        if not 1 <= slots <= limit:
            raise InputError(f"max_slots must be within 1..{limit} (the engine's max batch size), got {max_slots}")
        engine_len = int(engine.manifest.max_seq_len)
        if max_model_len is not None and not 2 <= max_model_len <= engine_len:
            raise InputError(f"max_model_len must be within 2..{engine_len} (the engine's max sequence length), got "
                             f"{max_model_len}")
        if max_queue < 0 or prefill_chunk < 1:
            raise InputError(f"max_queue must be >= 0 and prefill_chunk >= 1, got {max_queue} and {prefill_chunk}")
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.max_seq_len = engine_len if max_model_len is None else max_model_len  # a slot's positions
        self.vocab = int(engine.manifest.geometry["vocab_size"])
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        # a slot's KV positions: max_model_len, or fewer where no request can need more (engine.generate sizes them
        # for its prompts); ``reserve`` touches the buffers' memory now rather than mid-request
        self.cache = SlotCache(engine.session, slots, kv_capacity or self.max_seq_len, reserve=reserve)
        self._slots: list[Request | None] = [None] * slots  # touched by the stepping thread only
        self._waiting: deque[Request] = deque()
        self._cond = threading.Condition()  # guards _waiting, _closed, counters; wakes the thread
        self._step_lock = threading.Lock()  # one step at a time
        self._ids = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._prompt_tokens = self._generation_tokens = self._steps = 0
        self._last_step = 0.0  # time.monotonic() at the end of the last step (idle recomputes wait after it)
        self._beam_rows: set[int] = set()  # free rows a beam step left: its next step reuses their decoded KV as is
        self._finished: dict[str, int] = {}
        self._on_finish, self.prefix_caching = on_finish, prefix_caching
        self._prefix_queries = self._prefix_hits = 0  # prompt tokens looked up / found in a row's KV
        self._drafted = self._accepted = 0  # prompt-lookup draft tokens proposed / kept

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def __enter__(self) -> Scheduler:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Scheduler:
        """Run steps on a background thread whenever there is work."""
        with self._cond:
            if self._closed:
                raise ServingError("the scheduler is closed; make a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="trtinfer-scheduler", daemon=True)
                self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; requests still running or waiting fail with a ServingError (503)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._step_lock:
            with self._cond:
                left = self._running() + list(self._waiting)
                self._waiting.clear()
            for req in left:
                self._fail(req, 503, "did not finish: the scheduler was closed")
            self.cache.close()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._has_work() or self._unprefilled() is not None)
                if not self._closed and not self._has_work():  # idle: recompute once REFILL_DELAY_S passed
                    self._cond.wait_for(lambda: self._closed or self._has_work(),
                                        timeout=self._last_step + REFILL_DELAY_S - time.monotonic())
                if self._closed:
                    return
                idle = not self._has_work()
            try:
                if idle:
                    self._refill()
                else:
                    self.step()
            except Exception as e:  # not one request's failure (those end inside step): end every running one
                log.exception("scheduler step failed")
                with self._step_lock:
                    for req in self._running():
                        self._error(req, e)

    def _has_work(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._slots)

    def _unprefilled(self) -> int | None:
        """A free row holding decoded tokens (a finished answer) that no prompt could reuse yet, the most recent. Not
        a row a beam step left (``decode_tail``): beam search's next step continues from its decoded KV, and a
        recompute between two steps (a served search pauses while its thread picks the beams) would give it other
        numbers than ``engine.generate``'s search, which never pauses."""
        return self.cache.index.most_recent_unprefilled([s for s, r in enumerate(self._slots)
                                                         if r is None and s not in self._beam_rows])

    def _refill(self) -> None:
        """With nothing to run for :data:`REFILL_DELAY_S`: one chunk (:data:`REFILL_CHUNK` tokens, at most
        ``prefill_chunk``) of the most recent finished answer recomputed as a prompt's prefill computes it, so that a conversation's next turn reuses it
        (:class:`~trtinfer.runtime.prefix_cache.PrefixIndex`); a request that arrives waits for at most that chunk."""
        with self._step_lock:
            row = self._unprefilled() if self.cache.values else None
            if row is None:
                return
            try:
                self.cache.refill(row, min(self.prefill_chunk, REFILL_CHUNK))
            except Exception:  # the row keeps only its prefilled part: never tried again (no busy loop)
                log.exception("recomputing a finished answer's KV in row %d failed; it will not be reused", row)
                self.cache.keep(row, self.cache.index.prefilled[row])

    # --- submitting -------------------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], cfg: GenerationConfig | None = None, **options: Any) -> Request:
        """Queue a prompt (token ids) with its settings (default: the engine's generation defaults).

        Raises InputError for a prompt that does not fit (prompt + ``max_new_tokens`` over the model length, unless
        ``clip``: the request then ends with ``"length"`` when its row is full), ids outside the vocabulary, or
        settings a scheduler does not run (beam search, several sequences in one request); QueueFullError when the
        waiting queue is full. Thread-safe.

        ``options`` (keywords of :func:`~trtinfer.runtime.request.new_request`): ``clip``; ``seed``: the request's
        seed sequence (default ``SeedSequence(cfg.seed).spawn(1)[0]``); ``logits_processor``: the user's hook (see
        :meth:`trtinfer.Engine.generate`); ``assistant``: an engine drafting for it (assisted decoding);
        ``text=False``: no incremental text (events carry ``""``; the result's text is decoded once, at the end),
        which stop strings override; ``keep_logits``: keep the logits of the last choice (:attr:`Request.last_logits`);
        ``min_reuse``: the shortest cached prefix worth taking (beam search's continuations reuse any);
        ``decode_tail``: the prompt's last token may follow a reused prefix alone, fed in the step's decode call (beam
        search's continuations: one call a step). Otherwise a prompt's last token is always prefilled with at least
        one token before it (:mod:`~trtinfer.runtime.prefill_plan` says why). ``internal``: a part of a larger
        request (beam search's steps), not counted by itself (:meth:`report`).
        """
        return self.submit_all([(prompt_ids, cfg)], **options)[0]

    def submit_all(self, items: Sequence[tuple[Sequence[int], GenerationConfig | None]], *,
                   queue_limit: bool = True, **options: Any) -> list[Request]:
        """Queue several sequences as ONE request (a server request's prompts x ``n`` choices, a beam step's
        continuations): every item is checked first, then all queue together (ids in arrival order) or none does.
        ``max_queue`` refuses the group only when that many sequences were already waiting, so an idle scheduler
        takes a group of any size (were each sequence checked alone, a request of more choices than ``max_queue``
        would be refused forever, and a refusal would leave its first choices queued). ``queue_limit=False``: no
        refusal (the rest of a request already admitted, such as beam search's later steps). ``options``:
        :meth:`submit`'s, for every item."""
        reqs = [new_request(self.engine, self.cache, self.max_seq_len, ids, cfg, **options) for ids, cfg in items]
        with self._cond:
            if self._closed:
                raise ServingError("the scheduler is closed")
            if queue_limit and len(self._waiting) >= self.max_queue:
                for req in reqs:  # an assistant's KV buffers go with the refused request
                    if req.proposer is not None:
                        req.proposer.close()
                raise QueueFullError(f"{len(self._waiting)} sequences are waiting for a slot (max_queue "
                                     f"{self.max_queue}); retry later")
            for req in reqs:
                req.id = next(self._ids)
            self._waiting.extend(reqs)
            self._cond.notify_all()
        return reqs

    def stats(self) -> dict[str, Any]:
        """A snapshot for metrics (thread-safe): ``running`` (requests holding a slot, prefilling or decoding),
        ``waiting`` (queued for a slot), ``slots_used``, ``slots_total``, ``queue_capacity``, the counters
        ``prompt_tokens`` (prompt tokens in the KV: prefilled or reused) and ``generation_tokens`` (generated),
        ``requests_finished`` (by finish reason, ``"error"`` included), ``steps``, and the prefix cache's
        ``prefix_cache_queries`` (prompt tokens looked up) and ``prefix_cache_hits`` (of those, found in a row's KV and
        not prefilled), and prompt lookup's ``spec_decode_draft_tokens`` (proposed) and ``spec_decode_accepted_tokens``
        (kept)."""
        with self._cond:
            used = sum(r is not None for r in self._slots)
            return {"running": used, "waiting": len(self._waiting), "slots_used": used, "slots_total": len(self._slots),
                    "queue_capacity": self.max_queue, "prompt_tokens": self._prompt_tokens,
                    "generation_tokens": self._generation_tokens, "requests_finished": dict(self._finished),
                    "steps": self._steps, "prefix_cache_queries": self._prefix_queries,
                    "prefix_cache_hits": self._prefix_hits, "spec_decode_draft_tokens": self._drafted,
                    "spec_decode_accepted_tokens": self._accepted}

    # --- one step -----------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Retire, admit, prefill up to ``prefill_chunk`` prompt tokens, decode once; True while work remains."""
        with self._step_lock:
            if not self.cache.values:  # closed
                raise ServingError("the scheduler is closed")
            self._retire_cancelled()
            self._admit()
            self._prefill()
            self._decode()
            with self._cond:
                self._steps += 1
                self._last_step = time.monotonic()
                return self._has_work()

    def _running(self) -> list[Request]:
        """Requests holding a slot, in arrival order."""
        return sorted((r for r in self._slots if r is not None), key=lambda r: r.id)

    def _retire_cancelled(self) -> None:
        with self._cond:
            gone = [r for r in self._waiting if r.cancelled]
            for r in gone:
                self._waiting.remove(r)
        for req in gone + [r for r in self._running() if r.cancelled]:
            try:
                tail = "" if req._decoder is None else req._decoder.finish()
            except Exception as e:  # noqa: BLE001  it ends with the error (a waiting one is no longer queued: were
                self._error(req, e)  # the step to fail instead, nothing would ever end it and its reader would hang)
                continue
            self._finish(req, "cancelled", None, Event(None, tail, None, "cancelled", None, time.perf_counter()))

    def _admit(self) -> None:
        while True:
            with self._cond:
                if None not in self._slots:
                    return
                req = next((r for r in self._waiting if not self._await_prefix(r)), None)
                if req is None:
                    return
                self._waiting.remove(req)
                free = [s for s, r in enumerate(self._slots) if r is None]
            try:
                slot = self._place(req, free) if self.prefix_caching else free[0]  # lowest: short decode range
            except Exception as e:  # noqa: BLE001  (a prefix copy failed): this request ends, not the loop
                self._error(req, e)
                continue
            with self._cond:
                self._slots[slot], req.slot, req.t_admit = req, slot, time.perf_counter()

    def _await_prefix(self, req: Request) -> bool:
        """Whether ``req`` waits for a running request still prefilling the same prefix (the ``n`` choices of one
        prompt, clients sharing a system prompt): once that prefix is in a row it is copied, not computed twice."""
        return self.prefix_caching and any(
            other is not None and other.num_computed < len(other.prompt_ids)
            and (common := common_prefix(head(req), other.prompt_ids)) >= req.min_reuse
            and common > other.num_computed
            for other in self._slots)

    def _place(self, req: Request, free: list[int]) -> int:
        """The free row a request takes, holding the longest reusable prefix of its prompt (its ``num_computed``)."""
        row, n = self.cache.index.longest(head(req), range(len(self._slots)), decoded=req.decode_tail)  # any row
        if n < req.min_reuse:
            row, n = None, 0
        # a free row holding the prefix is taken as it is; else the least recently used one, the prefix copied in
        slot = row if row in free else self.cache.index.least_recent(free)
        self._beam_rows.discard(slot)
        self.cache.keep(slot, n if slot == row else 0)
        if row is not None and slot != row:
            self.cache.copy_prefix(row, slot, n)
        req.num_computed = n
        with self._cond:
            self._prefix_queries += len(req.prompt_ids)
            self._prefix_hits += n
            self._prompt_tokens += 0 if req.internal else n  # as vLLM counts: every prompt token, reused or not
        return slot

    def _prefill(self) -> None:
        """Up to ``prefill_chunk`` prompt tokens: new prompts in neighbouring empty rows that fit the budget whole go
        as ONE batched call per run of rows; the rest, oldest request first, in batch-1 chunks into their slots.
        While requests are decoding, a step makes ONE prefill call: on a CPU a call reads every weight once, as the
        decode call does, so a chunk of a few tokens costs most of a decode step (SmolLM2-135M fp32 on 2 cores: ~35 ms
        a call + ~0.7 ms a token, decode at batch 8 ~45 ms), and steps with 4-7 short chunks made 220-390 ms gaps."""
        running = self._running()
        one_call = any(r.next_token is not None for r in running)  # others decoding: they wait for this step
        budget, calls = self.prefill_chunk, 0
        # none where the graph gives logits at the last position only: the rows of one call could not be read apart
        fresh = [r for r in running if r.num_computed == 0 and r.slot is not None and not self.cache.length(r.slot)]
        for run in fresh_runs(fresh, budget) if self.cache.every_position else []:
            if one_call and calls:
                break
            rows = [r.prompt_ids for r in run]
            calls += 1
            try:
                outs = self.cache.prefill_rows(run[0].slot or 0, rows)
            except Exception as e:  # noqa: BLE001  the call failed: each of its requests ends with the error
                for req in run:
                    self._error(req, e)
                continue
            budget -= len(run) * max(map(len, rows))
            self._emit_all([(req, lg) for req, lg in zip(run, outs) if self._prefilled(req, len(req.prompt_ids))])
        for req in running:
            if budget <= 0 or (one_call and calls):
                break
            todo = len(req.prompt_ids) - req.num_computed
            if req.slot is None or todo == 0 or tail_due(req):
                continue
            n = chunk_size(req, todo, budget, first=not calls)
            if not n:
                continue
            calls += 1
            try:
                logits = self.cache.prefill(req.slot, req.prompt_ids[req.num_computed:req.num_computed + n])
                budget -= n
                if self._prefilled(req, n):
                    self._emit_all([(req, logits)])
            except Exception as e:  # noqa: BLE001  one request's failure ends that request only
                self._error(req, e)

    def _prefilled(self, req: Request, n: int) -> bool:
        """``n`` more prompt tokens of ``req`` are in its row; True at the prompt's end (its first token is due)."""
        req.num_computed += n
        with self._cond:
            self._prompt_tokens += 0 if req.internal else n
        if req.num_computed < len(req.prompt_ids):
            return False
        req._batch_size = sum(r is not None for r in self._slots)
        return True

    def _decode(self) -> None:
        """One batched step over every request with a token to feed (its last token, or a prompt's last after a
        reused prefix); a request with a draft (prompt lookup, an assistant) instead verifies it in its own pass
        (its token and the draft, logits at each)."""
        running = self._running()
        tails = [r for r in running if tail_due(r)]
        batch = []
        for req in [r for r in running if r.next_token is not None]:
            try:
                draft = self._draft(req)
            except Exception as e:  # noqa: BLE001  an assistant's failure ends that request only
                self._error(req, e)
                continue
            if draft:
                self._speculate(req, draft)
            else:
                batch.append(req)
        batch += tails
        if not batch:
            return
        try:
            logits = self.cache.decode({r.slot: r.prompt_ids[-1] if r.next_token is None else r.next_token
                                        for r in batch if r.slot is not None})
        except Exception as e:  # noqa: BLE001  the whole batch failed: each of its requests ends with the error
            for req in batch:
                self._error(req, e)
            return
        for req in tails:
            self._prefilled(req, 1)
        self._emit_all([(req, logits[req.slot]) for req in batch if req.slot is not None])

    # --- endings ------------------------------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        if req.slot is not None:
            if req.decode_tail:
                self._beam_rows.add(req.slot)
            if not self.prefix_caching:  # else the row keeps its KV for later requests until it is evicted
                self.cache.free(req.slot)
            self._slots[req.slot] = None
            req.slot = None
        req.next_token = None
        if req.proposer is not None:  # an assistant's KV buffers go with the request
            req.proposer.close()

    def _count(self, reason: str) -> None:
        with self._cond:
            self._finished[reason] = self._finished.get(reason, 0) + 1

    def report(self, done: Finished) -> None:
        """Count a request served as several ``internal`` ones (beam search's steps) once, as the scheduler counts
        its own: its prompt tokens, ``on_finish``, the finish counters. Thread-safe."""
        with self._cond:
            self._prompt_tokens += done.prompt_tokens
        self._report(done)

    def _report(self, done: Finished) -> None:
        if self._on_finish is not None:
            try:
                self._on_finish(done)
            except Exception:  # a hook's bug (metrics) must not fail a request that finished
                log.exception("on_finish failed for a %s request", done.reason)
        self._count(done.reason)

    def _finish(self, req: Request, finish: str, stop: str | int | None, last: Event) -> None:
        self._release(req)
        if not req.internal:
            self._report(Finished(finish, len(req.prompt_ids), req.t_submit, req.t_first_token,
                                 tuple(req.token_times), last.time))
        timings = Timings.of_steps(len(req.prompt_ids), req._batch_size, req.t_admit or req.t_submit, req.token_times)
        text = req._decoder.text if req._decoder is not None else self.tokenizer.decode(req.generated)
        result = GenerationResult(list(req.generated), text, finish, list(req.prompt_ids), timings, stop,
                                  None if req._logprobs is None else list(req._logprobs),
                                  draft_tokens=req.drafted, accepted_tokens=req.accepted)
        req._push(last, result=result)

    def _fail(self, req: Request, status: int, why: str, cause: Exception | None = None) -> None:
        """End ``req`` with a ServingError of HTTP ``status``: ``request <id> <why>``."""
        self._release(req)
        err = ServingError(f"request {req.id} {why}")
        err.status, err.__cause__ = status, cause
        if not req.internal:
            self._count("error")
        req._push(None, error=err)

    def _error(self, req: Request, e: Exception) -> None:
        log.warning("request %s failed: %s", req.id, e)
        self._fail(req, 500, f"failed: {type(e).__name__}: {e}", e)
