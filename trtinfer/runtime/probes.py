"""What a forward pass can read at a position: probes (``Logits``, ``Distribution``, ``Logprob``, ``Logprobs``,
``Entropy``) and samplers (``Argmax``, ``Sampler``). Each turns one row of logits ``[V]`` into its value, in numpy.

Log-probabilities are computed in float64 from the float32 logits (the log-softmax of transformers' eager path in
float32 differs by rounding only), so probes agree with PyTorch eager to ~1e-6 on an fp32 engine.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from trtinfer.errors import InputError
from trtinfer.runtime.config import GREEDY_BELOW, is_int, is_number, token_ids


def log_softmax(logits: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """Log-softmax over the last axis, computed in ``dtype`` (float64 by default; beam search asks float32, as
    transformers computes it on float32 logits). A row whose maximum is not finite (all ``-inf``) is shifted by 0.
    The runtime's one log-softmax: probes, logprobs, beam search and scoring all call it."""
    x: np.ndarray = np.asarray(logits, dtype=dtype)
    m, log_sum = log_normalizer(x)
    return x - m - log_sum  # type: ignore[no-any-return]


def log_normalizer(x: np.ndarray, accumulate: type | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's shift ``m`` (its maximum; 0 where that is not finite) and ``log sum exp(x - m)``, both ``[.., 1]``:
    ``log_softmax(x) = x - m - log_sum``. The exponentials are taken in ``x``'s dtype and summed in ``accumulate``
    (default: the same): float32 logits summed in float64 give float64's log-softmax to ~1e-7 at a quarter of the
    memory traffic (:func:`trtinfer.runtime.scoring.log_softmax_at`)."""
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, x.dtype.type(0))
    e = np.subtract(x, m)
    np.exp(e, out=e)
    return m, np.log(e.sum(axis=-1, keepdims=True, dtype=accumulate or x.dtype))


def top_sorted(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of ``row``'s ``k`` largest values, largest first (ties in id order)."""
    k = min(k, row.shape[0])
    top = np.argpartition(-row, k - 1)[:k]
    return top[np.argsort(-row[top], kind="stable")].astype(np.int64)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Logits:
    """The raw logits at the position (float32 ``[V]``); read with ``out.logits(h)``."""

    kind = "logits"

    def compute(self, row: np.ndarray) -> np.ndarray:
        return row.astype(np.float32, copy=True)


@dataclass(frozen=True)
class Distribution:
    """The ``k`` most likely next tokens and their probabilities at ``temperature``; ``out.distribution(h)`` gives
    ``(ids, probs)`` sorted by probability, highest first."""

    temperature: float = 1.0
    k: int = 10
    kind = "distribution"

    def __post_init__(self) -> None:
        t, k = self.temperature, self.k
        if not (is_number(t) and GREEDY_BELOW <= t < float("inf") and is_int(k) and k >= 1):  # 1e-40 overflows
            raise InputError(f"Distribution needs a finite temperature >= {GREEDY_BELOW} and an integer k >= 1, got "
                             f"{t!r}, {k!r}")

    def compute(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lp = log_softmax(row / self.temperature)
        top = top_sorted(lp, self.k)
        return top, np.exp(lp[top])


@dataclass(frozen=True)
class Logprob:
    """log p(``token_id``) at the position; ``out.logprobs(h)`` gives a float."""

    token_id: int
    kind = "logprobs"

    def compute(self, row: np.ndarray) -> float:
        token_ids([self.token_id], "the probe's token id", row.shape[0])
        return float(log_softmax(row)[self.token_id])


@dataclass(frozen=True)
class Logprobs:
    """log p of each of ``token_ids`` at the position (scoring candidates); ``out.logprobs(h)`` gives float64 ``[N]``."""

    token_ids: Sequence[int] = field(default_factory=tuple)
    kind = "logprobs"

    def compute(self, row: np.ndarray) -> np.ndarray:
        ids = list(self.token_ids)
        token_ids(ids, "the probe's token ids", row.shape[0])
        return log_softmax(row)[ids]


@dataclass(frozen=True)
class Entropy:
    """The entropy (nats) of the next-token distribution at the position; ``out.entropy(h)``."""

    kind = "entropy"

    def compute(self, row: np.ndarray) -> float:
        lp = log_softmax(row)
        return float(-(np.exp(lp) * lp).sum())


@dataclass(frozen=True)
class Argmax:
    """Greedy choice: the most likely token; ``out.token(h)``."""

    kind = "token"

    def compute(self, row: np.ndarray) -> int:
        return int(np.argmax(row))


@dataclass(frozen=True)
class Sampler:
    """Draw a token at ``temperature`` from the top-k / top-p filtered distribution (transformers' order), with its
    own seeded generator; ``out.token(h)``."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    kind = "token"

    def __post_init__(self) -> None:
        from trtinfer.runtime.config import GenerationConfig

        GenerationConfig(do_sample=True, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                         seed=self.seed)  # the same checks and messages as generate's
        object.__setattr__(self, "_rng", np.random.default_rng(self.seed))

    def compute(self, row: np.ndarray) -> int:
        from trtinfer.runtime.sampling import filter_logits, softmax

        logits = filter_logits(row[None, :].astype(np.float32) / self.temperature, self.top_k, self.top_p)
        probs = softmax(logits.astype(np.float64))[0]
        return int(self._rng.choice(probs.shape[0], p=probs))  # type: ignore[attr-defined]
