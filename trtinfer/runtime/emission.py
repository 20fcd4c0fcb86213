"""How the scheduler's requests get their next tokens: selection batched over requests that share settings,
recording (events, logprobs, stop rules, grammar state), and speculative drafts verified in one pass.

:class:`Emission` is the part of :class:`~trtinfer.runtime.scheduler.Scheduler` that turns logits into tokens; the
scheduler (admission, prefill, decode, endings) inherits it and provides the slot cache, counters and endings.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from trtinfer.runtime.generator import run_logits_processor, token_logprobs
from trtinfer.runtime.proposers import trim_draft
from trtinfer.runtime.request import Event, Request, wake_once
from trtinfer.runtime.sampling import select_next


class Emission:
    """Token selection and recording for the scheduler (see the module docstring)."""

    # provided by the scheduler
    cache: Any
    max_seq_len: int
    _cond: threading.Condition
    _generation_tokens: int
    _drafted: int
    _accepted: int

    _finish: Callable[[Request, str, str | int | None, Event], None]
    _error: Callable[[Request, Exception], None]

    def _draft(self, req: Request) -> list[int]:
        """The request's next draft (none without a proposer), within what the request may still generate and its
        row may hold, cut before its first EOS id or a token ``no_repeat_ngram_size`` bans."""
        if req.proposer is None:
            return []
        seq = req.prompt_ids + req.generated  # its last token is the one fed next
        room = min(req.cfg.max_new_tokens - len(req.generated), self.max_seq_len - len(seq),
                   self.cache.capacity - len(seq)) - 1  # the model adds a token of its own after the draft
        if room <= 0:
            return []
        return trim_draft(req.proposer.propose(seq, room)[:room], seq, req.eos, req.cfg.no_repeat_ngram_size)

    def _speculate(self, req: Request, draft: list[int]) -> None:
        """Feed the request's token and ``draft`` in one pass; keep the draft while the model's own choices (made
        exactly as a decode step makes them) equal it, then its first differing choice; roll the row back to what
        was kept. Greedy output is plain greedy's; a seeded request draws one number per kept token, as plain
        decoding does."""
        assert req.slot is not None and req.next_token is not None
        start = self.cache.length(req.slot)
        try:
            logits = self.cache.prefill(req.slot, [req.next_token, *draft], every=True)
        except Exception as e:  # noqa: BLE001
            self._error(req, e)
            return
        req.drafted += len(draft)
        kept = 0
        try:
            for j in range(len(draft) + 1):
                tok = int(self._choose([req], logits[j][None, :])[0])
                match = j < len(draft) and tok == draft[j]
                kept += match
                req.accepted += match  # before the token is recorded: a request that ends on it counts it
                self._record(req, tok, logits[j])
                if req.slot is None or not match:  # it ended, or the model chose otherwise (or past the draft)
                    break
        except Exception as e:  # noqa: BLE001
            self._error(req, e)
            return
        finally:  # the server's counters agree with the requests' own, a failed verification's too
            with self._cond:
                self._drafted += len(draft)
                self._accepted += kept
        if req.slot is not None:  # still running: its row keeps the fed token and the kept draft
            self.cache.keep(req.slot, start + 1 + kept)

    def _emit_all(self, rows: list[tuple[Request, np.ndarray]]) -> None:
        """Choose and record the next token of each ``(request, logits [V])``: one batched selection per group of
        requests with the same settings object, hook and step (the rows of one ``engine.generate``), so a greedy
        batch is one argmax and the user's ``logits_processor`` sees the batch, as transformers' does. A failure
        ends its group's requests only."""
        groups: dict[tuple[Any, ...], list[tuple[Request, np.ndarray]]] = {}
        for req, lg in rows:
            key = (id(req.cfg), id(req.logits_processor), len(req.generated), req.eos)
            groups.setdefault(key, []).append((req, lg))
        with wake_once():  # the readers' event loops: one wake-up each for all these tokens
            for members in groups.values():
                reqs = [m[0] for m in members]
                try:
                    # one request (the server's rows: each its own settings): its row as it is (selection copies
                    # what it rewrites)
                    batch = members[0][1][None, :] if len(members) == 1 else np.stack([m[1] for m in members])
                    tokens = self._choose(reqs, batch)
                except Exception as e:  # noqa: BLE001  the group's selection failed (a user's hook): it ends
                    for req in reqs:
                        self._error(req, e)
                    continue
                for (req, lg), tok in zip(members, tokens):
                    try:
                        self._record(req, int(tok), lg)
                    except Exception as e:  # noqa: BLE001
                        self._error(req, e)

    @staticmethod
    def _choose(reqs: list[Request], logits: np.ndarray) -> np.ndarray:
        """The next token of each request (same settings, same step) from its row of ``logits [B, V]``:
        :func:`select_next` with each request's own generator, whose hook runs the user's processor where there is one
        (after the built-in processors, before the warpers: transformers' order), then each grammar's mask (a draft
        token outside it can then never be kept, and no processor can choose a token the grammar refuses; the
        built-in processors before it keep -inf at -inf and read no other token's logit, so the numbers are those of
        masking first)."""
        first = reqs[0]
        seen = [r._seen for r in reqs]

        def hook(x: np.ndarray) -> np.ndarray:
            if first.logits_processor is not None:
                x = run_logits_processor(first.logits_processor, seen, x)
            return x if all(r.matcher is None for r in reqs) else np.stack(
                [row if r.matcher is None else r.matcher.mask(row) for r, row in zip(reqs, x)])

        rngs = [r._rng for r in reqs if r._rng is not None]
        return select_next(logits, first.cfg, seen, len(first.generated), first.eos, rngs, hook=hook)

    def _record(self, req: Request, tok: int, logits: np.ndarray) -> None:
        """The request's next token ``tok`` (chosen from ``logits [V]``): push its event, finish it if it ends here."""
        cfg = req.cfg
        if req.matcher is not None:
            req.matcher.consume(tok)
        lp = token_logprobs(logits[None, :], np.array([tok]), cfg.top_logprobs)[0] if cfg.logprobs else None
        if req.keep_logits:
            req.last_logits = logits
        now = time.perf_counter()
        if req.t_first_token is None:
            req.t_first_token = now
        req.token_times.append(now)
        req.generated.append(tok)
        req._seen = np.append(req._seen, tok)
        if req._logprobs is not None and lp is not None:
            req._logprobs.append(lp)
        with self._cond:
            self._generation_tokens += 1
        dec = req._decoder
        delta = "" if dec is None else dec.add(tok)
        # out of time (max_time) first, then a halt the caller set (engine.generate's should_stop, asked every token)
        halt = ("length" if req._deadline is not None and now > req._deadline else
                "cancelled" if req.should_stop is not None and req.should_stop(len(req.generated)) else None)
        if halt is None and req.matcher is not None and req.matcher.done:
            halt = "stop"  # the grammar is complete: nothing but EOS could follow
        # the first rule that holds: a stop string (the decoder saw it), an EOS id, the length budget (max_new_tokens,
        # or the engine's max sequence length), else the halt
        finish: str | None
        stop: str | int | None = None
        if dec is not None and dec.stopped:
            finish, stop = "stop", dec.stop_string
        elif tok in req.eos:
            finish, stop = "stop", tok
        elif len(req.generated) >= cfg.max_new_tokens or len(req.prompt_ids) + len(req.generated) >= self.max_seq_len:
            finish = "length"
        else:
            finish = halt
        if finish is None:
            req.next_token = tok
            req._push(Event(tok, delta, lp, None, None, now))
            return
        tail = "" if dec is None else dec.finish()  # which settles the stop string that cut the text, if any
        if dec is not None and dec.stopped:
            finish, stop = "stop", dec.stop_string
        self._finish(req, finish, stop, Event(tok, delta + tail, lp, finish, stop, now))
