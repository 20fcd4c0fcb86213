"""Next-token selection in numpy, in transformers' processor order.

repetition penalty -> min_new_tokens (EOS blocked) -> greedy, or temperature -> top-k -> top-p -> sample.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trtinfer.runtime.config import GenerationConfig


def apply_repetition_penalty(logits: np.ndarray, seen: Sequence[np.ndarray], penalty: float) -> None:
    """In place, per row: logits of already-seen tokens are divided (if > 0) or multiplied (if < 0) by ``penalty``."""
    if penalty == 1.0:
        return
    for r, ids in enumerate(seen):
        if len(ids) == 0:
            continue
        uniq = np.unique(ids)
        vals = logits[r, uniq]
        logits[r, uniq] = np.where(vals < 0, vals * penalty, vals / penalty)


def top_k_top_p_filter(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Set logits outside the top-k and outside the smallest top-p nucleus to -inf (the first token always stays)."""
    out = logits.copy()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(out, vocab - top_k, axis=-1)[:, vocab - top_k][:, None]
        out[out < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-out, axis=-1, kind="stable")
        sorted_logits = np.take_along_axis(out, order, axis=-1)
        probs = softmax(sorted_logits)
        cum = np.cumsum(probs, axis=-1)
        remove_sorted = (cum - probs) > top_p  # tokens whose predecessors already cover top_p
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        out[remove] = -np.inf
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for -inf entries."""
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def select_next(logits: np.ndarray, cfg: GenerationConfig, seen: Sequence[np.ndarray], n_generated: int,
                eos_ids: Sequence[int], rngs: Sequence[np.random.Generator]) -> np.ndarray:
    """Pick one token per row of ``logits [B, V]``; ``rngs`` holds one generator per row (sampling only)."""
    logits = logits.astype(np.float32, copy=True)
    apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    if n_generated < cfg.min_new_tokens and eos_ids:
        logits[:, list(eos_ids)] = -np.inf
    if not cfg.do_sample:
        return logits.argmax(axis=-1).astype(np.int64)  # type: ignore[no-any-return]
    logits = top_k_top_p_filter(logits / cfg.temperature, cfg.top_k, cfg.top_p)
    probs = softmax(logits.astype(np.float64))
    out = np.empty(len(probs), dtype=np.int64)
    for r, p in enumerate(probs):
        out[r] = rngs[r].choice(len(p), p=p)
    return out
