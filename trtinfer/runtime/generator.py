"""What a generation gives and the checks every row goes through: results, timings, logprobs, stream events, the
prompt and hook checks of the one decode loop (:mod:`trtinfer.runtime.scheduler`; its stop rules are
:meth:`~trtinfer.runtime.emission.Emission._record`'s)."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trtinfer.errors import ConfigError, EngineLoadError, InputError
from trtinfer.runtime.config import GenerationConfig, token_ids
from trtinfer.runtime.probes import log_softmax, top_sorted
from trtinfer.runtime.tokenizer import EngineTokenizer

log = logging.getLogger(__name__)

#: ``fn(token_ids_per_row, logits [B, V]) -> logits``: each row's prompt + generated ids so far, the raw float32 logits
LogitsProcessor = Callable[[list[np.ndarray], np.ndarray], np.ndarray]


@dataclass
class Timings:
    """Per-prompt timings, as llama.cpp reports them: prompt eval and per-token eval."""

    prompt_tokens: int = 0
    batch_size: int = 1
    prefill_ms: float = 0.0  # time to first token (prefill of the whole batch + first selection)
    decode_ms: list[float] = field(default_factory=list)  # one entry per decode step this row took part in

    @classmethod
    def of_steps(cls, prompt_tokens: int, batch_size: int, start: float, ends: Sequence[float]) -> Timings:
        """A row that started at ``start`` and made a step (a token) at each of ``ends`` (``time.perf_counter()``):
        the first is the prefill (time to first token), later ones decode steps."""
        return cls(prompt_tokens, batch_size, (ends[0] - start) * 1000.0 if ends else 0.0,
                   [(b - a) * 1000.0 for a, b in itertools.pairwise(ends)])

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
    return [TokenLogprob(int(t), float(lp[r, int(t)]),
                         tuple((int(i), float(lp[r, i])) for i in top_sorted(lp[r], k)) if k else ())
            for r, t in enumerate(tokens)]


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
    ``draft_tokens`` / ``accepted_tokens`` (prompt lookup, an assistant): draft tokens proposed, and those the model
    agreed with and kept (each verification pass also keeps the model's own next token, not counted here).
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
    draft_tokens: int = 0
    accepted_tokens: int = 0


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
    return [token_ids(p, f"prompt {i}", vocab) for i, p in enumerate(prompts)]


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


def run_logits_processor(fn: LogitsProcessor, seen: list[np.ndarray], logits: np.ndarray) -> np.ndarray:
    """The user's logits processor applied to a copy, its result checked (same shape, a float array); the
    arguments in ``partial``'s order (``select_next``'s ``hook``)."""
    out = np.asarray(fn([row.copy() for row in seen], logits.astype(np.float32, copy=True)))
    if out.shape != logits.shape or not np.issubdtype(out.dtype, np.floating):
        raise InputError(f"logits_processor must return float logits of shape {logits.shape}, got "
                         f"{out.dtype} {out.shape}")
    top = out.max(axis=-1)  # NaN anywhere in a row makes its max NaN; -inf: every token masked
    if not (top > -np.inf).all():
        what = "NaN" if np.isnan(top).any() else "-inf for every token of a row"
        raise InputError(f"logits_processor returned {what}: no token can be chosen from that (mask tokens with "
                         "-inf, keep at least one finite or +inf)")
    return out


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
