"""Batched generation over a :class:`DecoderSession`: one ragged prefill, then batched decode.

Rows that finish leave the batch (their KV rows are dropped on the backend), so they stop costing compute. Each row
ends on its own: EOS, a stop string, ``max_new_tokens``, or its own prompt + generated tokens reaching the engine's
``max_seq_len``, whatever the other rows' lengths.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from trtinfer.errors import ConfigError, EngineLoadError, InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.forward import Context, Group
from trtinfer.runtime.probes import Argmax, log_softmax
from trtinfer.runtime.sampling import is_plain_greedy, select_next
from trtinfer.runtime.session import DecoderSession
from trtinfer.runtime.tokenizer import EngineTokenizer, IncrementalDecoder

log = logging.getLogger(__name__)

class _LastLogits:
    """The raw logits row at a position, without a copy (generate stacks the rows into its own array)."""

    kind = "logits"

    def compute(self, row: np.ndarray) -> np.ndarray:
        return row


_LAST_LOGITS = _LastLogits()
_NO_LOGITS, _NO_TOKENS = np.empty((0, 0), np.float32), np.empty(0, np.int64)

#: ``fn(token_ids_per_row, logits [B, V]) -> logits``: each row's prompt + generated ids so far, the raw float32 logits
LogitsProcessor = Callable[[list[np.ndarray], np.ndarray], np.ndarray]


@dataclass
class Timings:
    """Per-prompt timings, as llama.cpp reports them: prompt eval and per-token eval."""

    prompt_tokens: int = 0
    batch_size: int = 1
    prefill_ms: float = 0.0  # time to first token (prefill of the whole batch + first selection)
    decode_ms: list[float] = field(default_factory=list)  # one entry per decode step this row took part in

    def add_step(self, step: int, ms: float) -> None:
        """Record step ``step`` of this row: step 0 is the prefill (time to first token), later ones decode steps."""
        if step == 0:
            self.prefill_ms = ms
        else:
            self.decode_ms.append(ms)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode speed of this row (tokens after the first / their time)."""
        total = sum(self.decode_ms)
        return len(self.decode_ms) / total * 1000.0 if total > 0 else 0.0

    @property
    def total_ms(self) -> float:
        """Prefill plus all decode steps."""
        return self.prefill_ms + sum(self.decode_ms)

    def to_dict(self) -> dict[str, float | int]:
        """JSON-friendly summary."""
        return {"prompt_tokens": self.prompt_tokens, "batch_size": self.batch_size,
                "prefill_ms": round(self.prefill_ms, 3), "decode_steps": len(self.decode_ms),
                "decode_ms_per_token": round(sum(self.decode_ms) / max(1, len(self.decode_ms)), 3),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2), "total_ms": round(self.total_ms, 3)}


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives at its step (``top``: ``(id, logprob)``
    pairs, most likely first), as OpenAI's ``logprobs.content`` items carry them."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: np.ndarray, tokens: np.ndarray, k: int) -> list[TokenLogprob]:
    """Per row of ``logits [B,V]``: the chosen token's log-softmax and the top ``k`` (float64 math)."""
    lp = log_softmax(logits)
    out = []
    for r, t in enumerate(tokens):
        top: tuple[tuple[int, float], ...] = ()
        if k:
            ids = np.argpartition(-lp[r], k - 1)[:k]
            ids = ids[np.argsort(-lp[r, ids], kind="stable")]
            top = tuple((int(i), float(lp[r, i])) for i in ids)
        out.append(TokenLogprob(int(t), float(lp[r, int(t)]), top))
    return out


@dataclass
class GenerationResult:
    """One prompt's output: new token ids, their text, why generation stopped.

    ``token_ids`` are the generated ids, EOS included (as transformers returns it). ``text`` is
    ``tokenizer.decode(token_ids)`` (special tokens skipped), except after a stop string. A stop string is handled as
    vLLM does: generation stops at the token that completes it, ``token_ids`` keep that token, and ``text`` ends
    where the stop string starts (the stop string and anything after it are left out). So always::

        full = tokenizer.decode(token_ids)
        text == full[:full.find(stop_reason)] if isinstance(stop_reason, str) else text == full

    ``logprobs`` (with ``logprobs=True``): one :class:`TokenLogprob` per generated token, else None.
    ``score`` (beam search): the hypothesis' score, transformers' ``sequences_scores`` (sum of log-probabilities /
    ``len(token_ids) ** length_penalty``); None otherwise.
    ``finish_reason``: ``"stop"`` (EOS or a stop string), ``"length"`` (``max_new_tokens``, the row's prompt +
    generated tokens reached the engine's max sequence length, or ``max_time`` ran out) or ``"cancelled"`` (the
    ``should_stop`` callback returned True). ``stop_reason``: the stop string, or the EOS token
    id, that ended the row; None for ``"length"``.
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_ids: list[int]
    timings: Timings
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    score: float | None = None


@dataclass(frozen=True)
class StreamEvent:
    """A text delta of prompt ``index``; ``finish_reason`` is set on its last event."""

    index: int
    text: str
    token_id: int | None
    finish_reason: str | None = None


def check_prompts(prompts: Sequence[Sequence[int]], vocab: int, max_seq_len: int) -> list[list[int]]:
    """The prompts as int lists; InputError for none, an empty one, one too long, or ids outside the vocabulary."""
    if not prompts:
        raise InputError("no prompts given: pass at least one prompt or input_ids row")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty (0 tokens); give at least one token")
        if len(p) >= max_seq_len:
            raise InputError(f"prompt {i} has {len(p)} tokens; the engine's max sequence length is {max_seq_len} "
                             "(prompt + at least one new token); shorten it or rebuild with a larger --max-seq-len")
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise InputError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return [list(map(int, p)) for p in prompts]


def eos_ids(cfg: GenerationConfig, tokenizer: EngineTokenizer, vocab: int) -> tuple[int, ...]:
    """The EOS ids of a generation (none with ``ignore_eos``), each checked to be a row of the logits."""
    if cfg.ignore_eos:
        return ()
    eos = tuple(cfg.eos_token_ids if cfg.eos_token_ids is not None else tokenizer.eos_token_ids)
    bad = [t for t in eos if not 0 <= t < vocab]
    if bad and cfg.eos_token_ids is not None:
        raise ConfigError(f"eos_token_ids {bad[:5]} are outside the model's vocabulary of {vocab} tokens (ids 0.."
                          f"{vocab - 1}); pass ids of this model's tokenizer", field="eos_token_ids")
    if bad:
        raise EngineLoadError(f"the engine's eos_token_ids {bad[:5]} (manifest tokenizer.eos_token_ids) are outside "
                              f"the model's vocabulary of {vocab} tokens; rebuild the engine, or pass "
                              "eos_token_ids (or ignore_eos=True)")
    return eos


def check_hooks(logits_processor: LogitsProcessor | None, should_stop: Callable[[], bool] | None
                ) -> tuple[LogitsProcessor | None, Callable[[], bool] | None]:
    """The two hooks, each None or a callable (InputError otherwise)."""
    if logits_processor is not None and not callable(logits_processor):
        raise InputError("logits_processor must be a callable (token ids of each row, logits [B, V]) -> logits")
    if should_stop is not None and not callable(should_stop):
        raise InputError("should_stop must be a callable taking no arguments and returning True to stop")
    return logits_processor, should_stop


def user_hook(fn: LogitsProcessor, seen: list[np.ndarray], logits: np.ndarray) -> np.ndarray:
    """:func:`run_logits_processor` with the arguments in ``partial``'s order (``select_next``'s ``hook``)."""
    return run_logits_processor(fn, logits, seen)


def run_logits_processor(fn: LogitsProcessor, logits: np.ndarray, seen: list[np.ndarray]) -> np.ndarray:
    """The user's logits processor applied to a copy, its result checked (same shape, a float array)."""
    out = np.asarray(fn([row.copy() for row in seen], logits.astype(np.float32, copy=True)))
    if out.shape != logits.shape or not np.issubdtype(out.dtype, np.floating):
        raise InputError(f"logits_processor must return float logits of shape {logits.shape}, got "
                         f"{out.dtype} {out.shape}")
    return out


def row_finish(tok: int, dec: IncrementalDecoder | None, eos: Collection[int], generated: int, total: int,
               max_new_tokens: int, max_seq_len: int, halt: str | None = None) -> tuple[str | None, str | int | None]:
    """How a row ends on ``tok``, its ``generated``-th new token (``total`` with the prompt), as ``(finish_reason,
    stop_reason)``, or ``(None, None)`` while it goes on. First rule that holds: a stop string (``dec`` saw it), an
    EOS id, the length budget (``max_new_tokens``, or the engine's max sequence length), else ``halt`` (``"length"``
    past ``max_time``, ``"cancelled"``). The one order :class:`Generation` and the server's scheduler follow."""
    if dec is not None and dec.stopped:
        return "stop", dec.stop_string
    if tok in eos:
        return "stop", tok
    if generated >= max_new_tokens or total >= max_seq_len:
        return "length", None
    return halt, None


def settle(dec: IncrementalDecoder | None, finish: str, stop: str | int | None) -> tuple[str, str, str | int | None]:
    """A finished row's last text (what the decoder held back) and its final reasons: ``finish()`` settles which stop
    string cut the text, which the steps may not have seen yet."""
    if dec is None:
        return "", finish, stop
    tail = dec.finish()
    return (tail, "stop", dec.stop_string) if dec.stopped else (tail, finish, stop)


def warn_length_budget(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_seq_len: int) -> None:
    """Log one warning when a prompt leaves room for fewer than ``max_new_tokens`` below ``max_seq_len``.

    Such a row still runs and ends with ``finish_reason="length"``; without the warning a prompt that nearly fills
    the engine reads as a model that stopped at once. Prompts that do not fit at all are :func:`check_prompts`' job.
    """
    short = [(i, len(p)) for i, p in enumerate(prompts) if max_seq_len - max_new_tokens < len(p) < max_seq_len]
    if not short:
        return
    i, n = max(short, key=lambda s: s[1])
    more = f" ({len(short) - 1} other prompt(s) are cut short too)" if len(short) > 1 else ""
    log.warning("prompt %d has %d tokens, which leaves room for only %d of the %d requested new tokens within the "
                "engine's max sequence length %d%s; shorten the prompt or rebuild the engine with a larger "
                "--max-seq-len", i, n, max_seq_len - n, max_new_tokens, max_seq_len, more)


class Generation:
    """One batched generation. Iterate :meth:`events` for streaming, or call :meth:`run`; read :attr:`results` after.

    Every row's length is its own: a row finishes with ``"length"`` when its prompt + generated tokens reach the
    engine's ``max_seq_len``, so a short prompt next to a long one may generate more than ``max_seq_len - longest``
    tokens. Every KV layout holds that: ``shared_buffer`` and ``scatter_buffer`` rows are right-padded, each in its own
    buffer slots (``prefill`` allocates ``min(max_seq_len, longest + max_new_tokens + 1)`` of them, more than any row
    writes); the ``concat`` cache is left-padded and grows one column per step for all rows, to at most
    ``longest + max_new_tokens`` columns (which may exceed ``max_seq_len``), while each row's positions stay its own
    (below ``max_seq_len``, which is what the graph's position tables hold).
    """

    def __init__(self, session: DecoderSession, tokenizer: EngineTokenizer, prompts: Sequence[Sequence[int]],
                 cfg: GenerationConfig, max_batch_size: int, max_seq_len: int, *,
                 logits_processor: LogitsProcessor | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        if len(prompts) > max_batch_size:
            raise InputError(f"batch of {len(prompts)} prompts exceeds the engine's max batch size {max_batch_size}; "
                             "split it, or rebuild with a larger --max-batch-size")
        self.session, self.tok, self.cfg = session, tokenizer, cfg
        self.prompts = check_prompts(prompts, int(session.manifest.geometry["vocab_size"]), max_seq_len)
        self.max_seq_len = max_seq_len
        self.eos = eos_ids(cfg, tokenizer, int(session.manifest.geometry["vocab_size"]))
        self.results: list[GenerationResult] = []
        self.logits_processor, self.should_stop = check_hooks(logits_processor, should_stop)

    def events(self) -> Iterator[StreamEvent]:
        """Run the generation, yielding text deltas as tokens arrive; fills :attr:`results`."""
        return self._steps(deltas=True)

    @staticmethod
    def _pass(group: Group, contexts: list[Context], feeds: list[list[int]],
              greedy: bool) -> tuple[np.ndarray, np.ndarray]:
        """One batched pass: ``feeds[r]`` into ``contexts[r]``; returns (logits ``[B, V]``, no tokens) or, greedy, (no
        logits, tokens ``[B]``): the argmax then comes from the backend (on the device for TensorRT)."""
        passes, handles = [], []
        for ctx, feed in zip(contexts, feeds):
            f = ctx.forward()
            f.tokens.extend(feed)  # checked once, by the prompt checks and by being the model's own choices
            handles.append(f.sample(-1, Argmax())[0] if greedy else f._ask(-1, _LAST_LOGITS))
            passes.append(f)
        outs = group.run(passes)
        if outs is None:  # every live row feeds a prefill or one token: always one batched step
            raise RuntimeError("generation passes did not form one batched step")
        if greedy:
            return _NO_LOGITS, np.array([o.token(h) for o, h in zip(outs, handles)], dtype=np.int64)
        return np.stack([o.logits(h) for o, h in zip(outs, handles)]), _NO_TOKENS

    def run(self) -> list[GenerationResult]:
        """Run the generation without streaming: without stop strings, each row is detokenized once, at its end."""
        for _ in self._steps(deltas=False):
            pass
        return self.results

    def _steps(self, deltas: bool) -> Iterator[StreamEvent]:
        """The decode loop; yields one event per row per step when ``deltas`` (else nothing)."""
        cfg, n = self.cfg, len(self.prompts)
        width = max(len(p) for p in self.prompts)
        seeds = np.random.SeedSequence(cfg.seed).spawn(n) if cfg.do_sample else []
        rngs = [np.random.default_rng(s) for s in seeds]
        timings = [Timings(prompt_tokens=len(p), batch_size=n) for p in self.prompts]
        # text is needed step by step only to stream it or to find stop strings; otherwise one decode at the end
        decoders = [IncrementalDecoder(self.tok, cfg.stop) if deltas or cfg.stop else None for _ in range(n)]
        generated: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] | None = [[] for _ in range(n)] if cfg.logprobs else None
        finish: list[str | None] = [None] * n
        stop_reason: list[str | int | None] = [None] * n
        seen = [np.asarray(p, dtype=np.int64) for p in self.prompts]
        eos = frozenset(self.eos)

        active = list(range(n))  # batch row -> prompt index
        t0 = time.perf_counter()
        # KV room for the longest prompt plus every token this generation may add: no row writes more (a row stops
        # at max_new_tokens or at its own max_seq_len, and its last token is never fed back)
        capacity = min(self.max_seq_len, width + cfg.max_new_tokens + 1)
        # plain greedy needs no logits on the host: the session may pick the tokens where the logits are (TensorRT)
        greedy = is_plain_greedy(cfg) and self.logits_processor is None and cfg.response_format is None
        # structured outputs: one grammar state per row, masking its logits before selection
        matchers = None if cfg.response_format is None else [
            self.tok.grammars(int(self.session.manifest.geometry["vocab_size"])).matcher(cfg.response_format)
            for _ in range(n)]
        deadline = None if cfg.max_time is None else time.perf_counter() + cfg.max_time
        # one context per row, the rows of one batched cache: each step is one batched pass of the Forward layer
        group = Group(self.session, capacity)
        contexts = [Context(self.session, capacity, group) for _ in range(n)]
        logits, tokens = self._pass(group, [contexts[i] for i in active], self.prompts, greedy)
        step = 0
        while True:
            if not greedy:
                rows_seen = [seen[i] for i in active]
                # the user's processor runs after the built-in ones, before the warpers (transformers' order)
                hook = None if self.logits_processor is None else partial(user_hook, self.logits_processor, rows_seen)
                allowed = logits if matchers is None else np.stack(
                    [matchers[i].mask(logits[row]) for row, i in enumerate(active)])
                tokens = select_next(allowed, cfg, rows_seen, step, self.eos,
                                     [rngs[i] for i in active] if rngs else [], hook=hook)
                if matchers is not None:
                    for row, i in enumerate(active):
                        matchers[i].consume(int(tokens[row]))
                if logprobs is not None:
                    for i, item in zip(active, token_logprobs(logits, tokens, cfg.top_logprobs)):
                        logprobs[i].append(item)
            elapsed = (time.perf_counter() - t0) * 1000.0
            for i in active:
                timings[i].add_step(step, elapsed)
            step += 1
            # out of time (max_time) or cancelled (should_stop): every active row ends with the token it just got
            halt = ("length" if deadline is not None and time.perf_counter() > deadline else
                    "cancelled" if self.should_stop is not None and self.should_stop() else None)
            keep: list[int] = []
            for row, i in enumerate(active):
                tok = int(tokens[row])
                generated[i].append(tok)
                seen[i] = np.append(seen[i], tok)
                dec = decoders[i]
                delta = dec.add(tok) if dec is not None else ""
                # a row whose grammar is complete ends here (nothing but EOS could follow)
                done = halt or ("stop" if matchers is not None and matchers[i].done else None)
                end, why = row_finish(tok, dec, eos, len(generated[i]), len(self.prompts[i]) + len(generated[i]),
                                      cfg.max_new_tokens, self.max_seq_len, done)
                if end is None:
                    keep.append(row)
                else:
                    tail, finish[i], stop_reason[i] = settle(dec, end, why)
                    delta += tail
                if deltas:
                    yield StreamEvent(i, delta, tok, finish[i])
            if not keep:
                break
            if len(keep) < len(active):  # finished rows leave the batch (their KV rows are dropped next pass)
                for row, i in enumerate(active):
                    if row not in keep:
                        contexts[i].release()
                tokens = tokens[keep]
                active = [active[r] for r in keep]
            t0 = time.perf_counter()
            logits, tokens = self._pass(group, [contexts[i] for i in active], [[int(t)] for t in tokens], greedy)
        for c in contexts:
            c.release()

        texts = [d.text if d is not None else self.tok.decode(g) for d, g in zip(decoders, generated)]
        self.results = [
            GenerationResult(generated[i], texts[i], finish[i] or "length", self.prompts[i], timings[i], stop_reason[i],
                             None if logprobs is None else logprobs[i])
            for i in range(n)
        ]
