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

A context is a row of a slot cache (:mod:`trtinfer.runtime.slots`, the KV cache the scheduler runs on): its own
one-row cache, or a row of a batch. ``engine.contexts(n)`` makes ``n`` contexts that are the rows of one cache, and
``engine.execute([f1, f2, ...])`` runs their passes as ONE batched pass when they are contexts of that batch and
either all start their sequence in neighbouring rows (one prefill; asks at each pass's last token) or all feed one
token (one decode step). Other combinations run one after another, each on its own row.
:meth:`Context.release` ends a context.

Limits of the engines' KV layouts, said plainly: tokens always take the next positions (``input_at`` accepts only
those), and the causal mask is built inside the graph, so ``attention_mask`` is refused.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtinfer.errors import InputError
from trtinfer.runtime.config import is_int, token_ids
from trtinfer.runtime.probes import (
    Argmax,
    Distribution,
    Entropy,
    Logits,
    Logprob,
    Logprobs,
    Sampler,
)
from trtinfer.runtime.session import DecoderSession
from trtinfer.runtime.slots import SlotCache


@dataclass(frozen=True)
class Handle:
    """Names one value of a pass's :class:`Output`: what was asked (``kind``) and where (its index)."""

    index: int
    kind: str
    position: int


class Output:
    """The values a pass computed; read each through the handle its probe or sampler returned."""

    def __init__(self, values: list[Any], handles: list[Handle]) -> None:
        self._values, self._handles = values, handles

    def _get(self, h: Handle, kind: str) -> Any:
        if not isinstance(h, Handle) or h.index >= len(self._values) or self._handles[h.index] != h:
            raise InputError("this handle does not belong to this pass's output")
        if h.kind != kind:
            raise InputError(f"the handle is a {h.kind} handle; read it with out.{h.kind}(h), not out.{kind}(h)")
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
        self.tokens.extend(token_ids(ids, "input()", int(self.ctx.session.manifest.geometry["vocab_size"])))
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

    def _ask(self, position: int, what: Any) -> Handle:
        n = len(self.tokens)
        p = position + n if position < 0 else position
        if not 0 <= p < n:
            raise InputError(f"position {position} is outside this pass's {n} input tokens")
        h = Handle(len(self._asks), what.kind, p)
        self._asks.append((h, what))
        return h

    def probe(self, position: int, probe: Logits | Distribution | Logprob | Logprobs | Entropy) -> Handle:
        """Read ``probe`` at ``position``; the handle reads the value from :meth:`execute`'s output."""
        if not isinstance(probe, (Logits, Distribution, Logprob, Logprobs, Entropy)):
            raise InputError(f"probe() takes Logits, Distribution, Logprob, Logprobs or Entropy, got "
                             f"{type(probe).__name__}")
        if isinstance(probe, (Logprob, Logprobs)):  # now, not after the pass ran (the context would have moved on)
            ids = [probe.token_id] if isinstance(probe, Logprob) else list(probe.token_ids)
            token_ids(ids, "the probe's token ids", int(self.ctx.session.manifest.geometry["vocab_size"]))
        return self._ask(position, probe)

    def sample(self, positions: Sequence[int] | int, sampler: Argmax | Sampler) -> list[Handle]:
        """Choose a token at each of ``positions`` with ``sampler``; one handle per position."""
        if not isinstance(sampler, (Argmax, Sampler)):
            raise InputError(f"sample() takes Argmax() or Sampler(...), got {type(sampler).__name__}")
        return [self._ask(p, sampler) for p in ([positions] if isinstance(positions, int) else positions)]

    def _check_runnable(self) -> None:
        if self._done:
            raise InputError("this forward pass already ran; start another with ctx.forward()")
        if not self.tokens:
            raise InputError("nothing to run: feed tokens with .input() first")
        self.ctx._check_alive()

    def execute(self) -> Output:
        """Run the pass: the context takes the tokens; the asked values are computed from their positions' logits."""
        self._check_runnable()
        logits = self.ctx._run(self.tokens, sorted({h.position for h, _ in self._asks}))
        self._done = True
        return self._output(logits)

    def _output(self, logits: dict[int, np.ndarray]) -> Output:
        return Output([what.compute(logits[h.position]) for h, what in self._asks], [h for h, _ in self._asks])


class Group:
    """The contexts of ``engine.contexts(n)``: rows ``0..n-1`` of one slot cache (:mod:`trtinfer.runtime.slots`)."""

    def __init__(self, session: DecoderSession, n: int, capacity: int) -> None:
        self.cache = SlotCache(session, n, capacity, reserve=False)
        self.capacity = capacity
        self.contexts = [Context(session, capacity, self, slot) for slot in range(n)]

    def run(self, passes: list[Forward]) -> list[Output] | None:
        """The passes as one batched call, or None when they do not make one (then they run one by one): prompts
        into empty neighbouring rows (asks at each last token), or one token into each row (a decode step)."""
        ctxs = [f.ctx for f in passes]
        if any(c.group is not self for c in ctxs) or any(h.position != len(f.tokens) - 1
                                                        for f in passes for h, _ in f._asks):
            return None
        slots = sorted(c.slot for c in ctxs)
        cache = self.cache
        if all(not c.tokens for c in ctxs) and slots == list(range(slots[0], slots[0] + len(slots))):
            too_long = [len(f.tokens) for f in passes if len(f.tokens) > self.capacity]
            if too_long:
                raise InputError(f"a prompt of {too_long[0]} tokens does not fit the contexts' capacity of "
                                 f"{self.capacity} (engine.contexts(n, capacity=...), up to the engine's max sequence "
                                 f"length {cache.session.manifest.max_seq_len})")
            by_slot = {f.ctx.slot: f.tokens for f in passes}
            values = dict(zip(slots, cache.prefill_rows(slots[0], [by_slot[s] for s in slots])))
        elif all(len(f.tokens) == 1 and c.tokens for f, c in zip(passes, ctxs)):
            # every row up to the last fed one runs (rows not fed get a dummy token at their length): each must fit
            if int(cache.lengths[:slots[-1] + 1].max()) + 1 > self.capacity:
                return None
            values = cache.decode({f.ctx.slot: f.tokens[0] for f in passes})
        else:
            return None
        for f in passes:
            f._done = True
        return [f._output({len(f.tokens) - 1: values[f.ctx.slot]}) for f in passes]


def execute(passes: Sequence[Forward]) -> list[Output]:
    """Run several contexts' passes: as one batch where :meth:`Group.run` allows it, else one after another."""
    passes = list(passes)
    if not all(isinstance(f, Forward) for f in passes):
        raise InputError("execute() takes a list of forward passes (ctx.forward()...)")
    if len({id(f.ctx) for f in passes}) != len(passes):  # a pass given twice shares its context too
        raise InputError("execute() takes one pass per context; run a context's second pass after the first")
    for f in passes:
        f._check_runnable()
    group = passes[0].ctx.group if len(passes) > 1 else None
    outs = None if group is None else group.run(passes)
    return outs if outs is not None else [f.execute() for f in passes]


def check_capacity(capacity: Any, manifest: Any) -> None:
    """InputError unless ``capacity`` is None or an integer 2..max_seq_len."""
    max_len = manifest.max_seq_len
    if capacity is not None and not (is_int(capacity) and 2 <= capacity <= max_len):
        raise InputError(f"capacity must be an integer between 2 and the engine's max sequence length {max_len}, "
                         f"got {capacity!r}")


class Context:
    """One sequence on an engine: its tokens and its KV cache, a row of a slot cache (the engine's own buffers, on its
    device): a cache of its own, or a row of a :class:`Group`'s."""

    def __init__(self, session: DecoderSession, capacity: int, group: Group | None = None, slot: int = 0) -> None:
        check_capacity(capacity, session.manifest)
        self.session, self.capacity, self.group, self.slot = session, capacity, group, slot
        self.cache = SlotCache(session, 1, capacity, reserve=False) if group is None else group.cache
        self.released = False

    @property
    def tokens(self) -> list[int]:
        """The tokens whose KV this context holds."""
        return self.cache.index.tokens[self.slot]

    def release(self) -> None:
        """End this context: its row is free for nothing else (a group's) or its buffers are freed."""
        if not self.released:
            if self.group is None:
                self.cache.close()
            else:
                self.cache.free(self.slot)
        self.released = True

    def __len__(self) -> int:
        return len(self.tokens)

    def forward(self) -> Forward:
        """A new pass on this context."""
        return Forward(self)

    def _run(self, tokens: list[int], positions: list[int]) -> dict[int, np.ndarray]:
        want = positions or [len(tokens) - 1]  # a pass nobody reads still fills the cache
        if want != [len(tokens) - 1]:
            self.session.check_can_score()  # logits at chosen positions
        if len(self.tokens) + len(tokens) > self.capacity:
            raise InputError(f"the context holds {len(self.tokens)} tokens and room for {self.capacity}; "
                             f"{len(tokens)} more do not fit (engine.context(capacity=...) up to the max sequence "
                             f"length {self.session.manifest.max_seq_len})")
        logits = self.cache.feed(self.slot, tokens, want)
        return {p: logits[i] for i, p in enumerate(want)}

    def _check_alive(self) -> None:
        if self.released:
            raise InputError("this context was released; make a new one with engine.context()")

    def fork(self) -> Context:
        """A copy of this context (tokens and KV cache, copied on the backend); the two then go their own ways."""
        self._check_alive()
        other = Context(self.session, self.capacity)
        if self.tokens:
            self.cache.copy_prefix(self.slot, 0, len(self.tokens), into=other.cache)
        return other

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` tokens (e.g. rejected draft tokens); later passes continue from there."""
        self._check_alive()
        if not is_int(n) or not 0 <= n <= len(self.tokens):
            raise InputError(f"truncate({n}): the context holds {len(self.tokens)} tokens")
        self.cache.keep(self.slot, n)
