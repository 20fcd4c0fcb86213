"""Contexts and the Forward builder: one sequence's KV cache, fed pass by pass, read through probes.

::

    ctx = engine.context()                       # an empty sequence (its own KV buffers on the engine's device)
    fwd = ctx.forward().input(tok.encode("The capital of France is"))
    h_next = fwd.sample([-1], Argmax())[0]       # the token after the last input
    h_ent = fwd.probe(-1, Entropy())
    out = fwd.execute()                          # one pass; the context now holds the 6 tokens
    out.token(h_next), out.entropy(h_ent)
    alt = ctx.fork()                             # a copy of the cache, made on the backend
    ctx.truncate(3)                              # roll back to the first 3 tokens (rejected drafts)

Positions index this pass's input tokens (0 = the first token fed in this pass; negative from the end). A pass
computes the LM head only at the positions some probe or sampler reads. Sampled tokens are not fed back by
themselves: the next pass's ``.input`` does that, so a caller can verify drafts, branch or stop.

Several sequences batch: ``engine.contexts(n)`` makes ``n`` contexts whose caches are the rows of one batched KV
cache, and ``engine.execute([f1, f2, ...])`` runs their passes as ONE batched pass when they are all of a group's
live contexts and either all start their sequence (one prefill; probes at each pass's last token) or all feed one
token (one decode step). Other combinations run one after another, each context first taking its row out of the
batch (a gather on the device). :meth:`Context.release` ends a context: its row leaves the batch at the next step.
``generate`` is this loop.

Limits of the engines' KV layouts, said plainly: tokens always take the next positions (``input_at`` accepts only
those), and the causal mask is built inside the graph, so ``attention_mask`` is refused.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtinfer.errors import InputError
from trtinfer.runtime.probes import Argmax, Distribution, Entropy, Logits, Logprob, Logprobs, Sampler
from trtinfer.runtime.session import DecoderSession, KVCache

_READERS = {"token": "token", "logits": "logits", "distribution": "distribution", "logprobs": "logprobs",
            "entropy": "entropy"}


@dataclass(frozen=True)
class Handle:
    """Names one value of a pass's :class:`Output`: what was asked (``kind``) and where (its index)."""

    index: int
    kind: str
    position: int


class Output:
    """The values a pass computed; read each through the handle its probe or sampler returned."""

    def __init__(self, values: list[Any], handles: list[Handle]) -> None:
        self._values = values
        self._handles = handles

    def _get(self, h: Handle, kind: str) -> Any:
        if not isinstance(h, Handle) or h.index >= len(self._values) or self._handles[h.index] != h:
            raise InputError("this handle does not belong to this pass's output")
        if h.kind != kind:
            raise InputError(f"the handle is a {h.kind} handle; read it with out.{_READERS[h.kind]}(h), not "
                             f"out.{_READERS[kind]}(h)")
        return self._values[h.index]

    def token(self, h: Handle) -> int:
        """The token a sampler chose."""
        return int(self._get(h, "token"))

    def logits(self, h: Handle) -> np.ndarray:
        """float32 logits ``[V]`` of a :class:`Logits` probe."""
        return self._get(h, "logits")  # type: ignore[no-any-return]

    def distribution(self, h: Handle) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, probs)`` of a :class:`Distribution` probe, most likely first."""
        return self._get(h, "distribution")  # type: ignore[no-any-return]

    def logprobs(self, h: Handle) -> Any:
        """A float (:class:`Logprob`) or float64 ``[N]`` (:class:`Logprobs`)."""
        return self._get(h, "logprobs")

    def entropy(self, h: Handle) -> float:
        """Entropy in nats of an :class:`Entropy` probe."""
        return float(self._get(h, "entropy"))


class Forward:
    """One pass over a context: feed tokens, ask for values at positions, :meth:`execute`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.tokens: list[int] = []
        self._asks: list[tuple[Handle, Any]] = []
        self._done = False

    def input(self, ids: Sequence[int]) -> Forward:
        """Append tokens at the next positions."""
        vocab = int(self.ctx.session.manifest.geometry["vocab_size"])
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise InputError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        self.tokens.extend(int(t) for t in ids)
        return self

    def input_at(self, ids: Sequence[int], positions: Sequence[int]) -> Forward:
        """Tokens at explicit sequence positions; the engines' KV layouts place token t at position t, so these must
        be the next positions (anything else is refused, not reordered)."""
        start = len(self.ctx.tokens) + len(self.tokens)
        if list(positions) != list(range(start, start + len(ids))):
            raise InputError(f"input_at: the engine's KV layout writes tokens at the next positions only "
                             f"({start}..{start + len(ids) - 1}), got {list(positions)[:8]}")
        return self.input(ids)

    def attention_mask(self, mask: Any) -> Forward:
        """Refused: every engine layout builds its causal (and sliding-window) mask inside the graph."""
        raise InputError("custom attention masks are not supported: the engine's graph builds the causal mask from "
                         "positions (concat, shared_buffer and scatter_buffer layouts alike)")

    def _position(self, position: int) -> int:
        n = len(self.tokens)
        p = position + n if position < 0 else position
        if not 0 <= p < n:
            raise InputError(f"position {position} is outside this pass's {n} input tokens")
        return p

    def _ask(self, position: int, what: Any) -> Handle:
        h = Handle(len(self._asks), what.kind, self._position(position))
        self._asks.append((h, what))
        return h

    def probe(self, position: int, probe: Logits | Distribution | Logprob | Logprobs | Entropy) -> Handle:
        """Read ``probe`` at ``position``; the handle reads the value from :meth:`execute`'s output."""
        if not isinstance(probe, (Logits, Distribution, Logprob, Logprobs, Entropy)):
            raise InputError(f"probe() takes Logits, Distribution, Logprob, Logprobs or Entropy, got "
                             f"{type(probe).__name__}")
        return self._ask(position, probe)

    def sample(self, positions: Sequence[int] | int, sampler: Argmax | Sampler) -> list[Handle]:
        """Choose a token at each of ``positions`` with ``sampler``; one handle per position."""
        if not isinstance(sampler, (Argmax, Sampler)):
            raise InputError(f"sample() takes Argmax() or Sampler(...), got {type(sampler).__name__}")
        pos = [positions] if isinstance(positions, int) else list(positions)
        return [self._ask(p, sampler) for p in pos]

    def _check_runnable(self) -> None:
        if self._done:
            raise InputError("this forward pass already ran; start another with ctx.forward()")
        if not self.tokens:
            raise InputError("nothing to run: feed tokens with .input() first")
        if self.ctx.released:
            raise InputError("this context was released; make a new one with engine.context()")

    def execute(self) -> Output:
        """Run the pass: the context takes the tokens; the asked values are computed from their positions' logits."""
        self._check_runnable()
        self.ctx._own()  # a row of a batch runs alone: it takes its row out first
        logits = self.ctx._run(self.tokens, sorted({h.position for h, _ in self._asks}))
        self._done = True
        return self._output(logits)

    def _output(self, logits: dict[int, np.ndarray]) -> Output:
        return Output([what.compute(logits[h.position]) for h, what in self._asks], [h for h, _ in self._asks])

    def _greedy_only(self) -> bool:
        """Every ask is an Argmax at the last token (the backend may pick tokens where the logits are)."""
        last = len(self.tokens) - 1
        return bool(self._asks) and all(isinstance(w, Argmax) and h.position == last for h, w in self._asks)


class Group:
    """Contexts whose KV caches are the rows of one batched cache (``engine.contexts(n)``); ``rows`` lists the
    contexts in row order, None for a row whose context left (dropped from the cache at the next batched step)."""

    def __init__(self, session: DecoderSession, capacity: int) -> None:
        self.session = session
        self.capacity = capacity
        self.kv: KVCache | None = None
        self.rows: list[Context | None] = []

    def live(self) -> list[Context]:
        """Member contexts, in row order."""
        return [c for c in self.rows if c is not None]

    def _compact(self) -> None:
        """Drop the rows of contexts that left (one gather), so rows = live contexts."""
        keep = [i for i, c in enumerate(self.rows) if c is not None]
        if len(keep) == len(self.rows):
            return
        self.kv = None if self.kv is None or not keep else self.session.select_rows(self.kv, keep)
        self.rows = [self.rows[i] for i in keep]

    def leave(self, ctx: Context, take_row: bool) -> KVCache | None:
        """``ctx`` leaves the group; with ``take_row`` its row of the cache comes with it (a one-row cache)."""
        i = self.rows.index(ctx)
        row = None
        if take_row and self.kv is not None:
            row = self.kv if len(self.rows) == 1 else self.session.select_rows(self.kv, [i])
        self.rows[i] = None
        if not self.live():
            self.kv, self.rows = None, []
        return row

    def run(self, passes: list[Forward]) -> list[Output] | None:
        """The passes as one batched step, or None when they do not make one (then they run one by one)."""
        live = self.live()
        if len(passes) != len(live) or {id(f.ctx) for f in passes} != {id(c) for c in live}:
            return None
        by_ctx = {id(f.ctx): f for f in passes}
        ordered = [by_ctx[id(c)] for c in live]
        fresh = self.kv is None and all(not c.tokens for c in live)
        last_only = all(h.position == len(f.tokens) - 1 for f in ordered for h, _ in f._asks)
        if fresh and last_only:
            too_long = [len(f.tokens) for f in ordered if len(f.tokens) > self.capacity]
            if too_long:
                raise InputError(f"a prompt of {too_long[0]} tokens does not fit the contexts' capacity of "
                                 f"{self.capacity} (engine.contexts(n, capacity=...), up to the engine's max sequence "
                                 f"length {self.session.manifest.max_seq_len})")
            self.rows = list(live)
            tokens = [f.tokens for f in ordered]
            greedy = all(f._greedy_only() for f in ordered)
            if greedy:
                values, self.kv = self.session.prefill_greedy(tokens, self.capacity)
            else:
                values, self.kv = self.session.prefill(tokens, self.capacity)
        elif self.kv is not None and all(len(f.tokens) == 1 for f in ordered) and all(c.tokens for c in live):
            self._compact()
            col = np.array([f.tokens[0] for f in ordered], dtype=np.int64)
            if any(len(c.tokens) + 1 > self.capacity for c in live):
                raise InputError(f"a context of this batch would hold more than its capacity of {self.capacity} "
                                 "tokens (engine.contexts(n, capacity=...))")
            greedy = all(f._greedy_only() for f in ordered)
            if greedy:
                values, self.kv = self.session.decode_greedy(col, self.kv)
            else:
                values, self.kv = self.session.decode(col, self.kv)
        else:
            return None
        outs = {}
        for r, f in enumerate(ordered):
            f.ctx.tokens.extend(f.tokens)
            f._done = True
            if greedy:
                outs[id(f)] = Output([int(values[r])] * len(f._asks), [h for h, _ in f._asks])
            else:
                outs[id(f)] = f._output({len(f.tokens) - 1: values[r]})
        return [outs[id(f)] for f in passes]


def execute(passes: Sequence[Forward]) -> list[Output]:
    """Run several contexts' passes: as one batch where :meth:`Group.run` allows it, else one after another."""
    passes = list(passes)
    if not all(isinstance(f, Forward) for f in passes):
        raise InputError("execute() takes a list of forward passes (ctx.forward()...)")
    if len({id(f) for f in passes}) != len(passes) or len({id(f.ctx) for f in passes}) != len(passes):
        raise InputError("execute() takes one pass per context; run a context's second pass after the first")
    for f in passes:
        f._check_runnable()
    groups = {id(f.ctx.group) for f in passes}
    if passes and len(groups) == 1 and passes[0].ctx.group is not None:
        outs = passes[0].ctx.group.run(passes)
        if outs is not None:
            return outs
    return [f.execute() for f in passes]


class Context:
    """One sequence on an engine: its tokens and its KV cache (the engine's own buffers, on its device), held alone
    or as a row of a :class:`Group`'s batched cache."""

    def __init__(self, session: DecoderSession, capacity: int, group: Group | None = None) -> None:
        max_len = session.manifest.max_seq_len
        if not 2 <= capacity <= max_len:
            raise InputError(f"capacity must be between 2 and the engine's max sequence length {max_len}, "
                             f"got {capacity}")
        self.session = session
        self.capacity = capacity
        self.tokens: list[int] = []
        self.kv: KVCache | None = None
        self.group = group
        self.released = False
        if group is not None:
            group.rows.append(self)

    def _own(self) -> None:
        """Leave the group (if any), taking this context's row of its cache along."""
        if self.group is not None:
            self.kv = self.group.leave(self, take_row=True)
            self.group = None

    def release(self) -> None:
        """End this context: its KV row leaves the batch (at the group's next step) or its buffers are freed."""
        if self.group is not None:
            self.group.leave(self, take_row=False)
            self.group = None
        self.kv = None
        self.released = True

    def __len__(self) -> int:
        return len(self.tokens)

    def forward(self) -> Forward:
        """A new pass on this context."""
        return Forward(self)

    def _run(self, tokens: list[int], positions: list[int]) -> dict[int, np.ndarray]:
        self.session.check_can_score()  # a pass alone needs logits at chosen positions
        if len(self.tokens) + len(tokens) > self.capacity:
            raise InputError(f"the context holds {len(self.tokens)} tokens and room for {self.capacity}; "
                             f"{len(tokens)} more do not fit (engine.context(capacity=...) up to the max sequence "
                             f"length {self.session.manifest.max_seq_len})")
        want = positions or [len(tokens) - 1]  # a pass nobody reads still fills the cache
        logits, self.kv = self.session.run_chunk(tokens, self.kv, self.capacity, positions=want)
        self.tokens.extend(tokens)
        return {p: logits[i] for i, p in enumerate(want)}

    def fork(self) -> Context:
        """A copy of this context (tokens and KV cache, copied on the backend); the two then go their own ways."""
        self._own()
        other = Context(self.session, self.capacity)
        other.tokens = list(self.tokens)
        other.kv = None if self.kv is None else self.session.copy_cache(self.kv)
        return other

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` tokens (e.g. rejected draft tokens); later passes continue from there."""
        if not 0 <= n <= len(self.tokens):
            raise InputError(f"truncate({n}): the context holds {len(self.tokens)} tokens")
        self._own()
        self.tokens = self.tokens[:n]
        self.kv = None if n == 0 or self.kv is None else self.session.truncate_cache(self.kv, n)
