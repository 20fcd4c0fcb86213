"""Feeds of the ``scatter_buffer`` KV layout (plain numpy), shared by every session that runs such a graph.

Right padding: row ``b``'s token ``t`` sits at position ``t`` and is written into slot ``t`` of its KV buffers (the
graph's ``TensorScatter`` writes a chunk at ``position_ids[:, 0]``); the graph masks slot ``j`` for query position
``p`` unless ``j <= p``. A short row's padding writes slots past its length, which its next decode step overwrites
before any query can see them::

    prefill  input_ids    [B,W]  prompts, right-padded         position_ids [B,W] 0..W-1     logits_positions [B,1] len-1
    decode   input_ids    [B,1]  one token per row             position_ids [B,1] len        logits_positions [B,1] 0
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trtinfer.errors import InputError

LOGITS_POSITIONS = "logits_positions"


def prefill_feeds(prompts: Sequence[Sequence[int]], pad_token_id: int,
                  capacity: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``(feeds, lengths)`` of a right-padded prefill of ``prompts`` into KV buffers of ``capacity`` slots."""
    n, width = len(prompts), max(len(p) for p in prompts)
    if width > capacity:
        raise InputError(f"a prompt of {width} tokens does not fit the engine's KV buffers of {capacity} positions; "
                         "shorten it or rebuild with a larger --max-seq-len")
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    ids = np.full((n, width), pad_token_id, dtype=np.int64)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = p
    pos = np.broadcast_to(np.arange(width, dtype=np.int64), (n, width)).copy()
    return {"input_ids": ids, "position_ids": pos, LOGITS_POSITIONS: (lengths - 1)[:, None]}, lengths


def decode_feeds(tokens: np.ndarray, lengths: np.ndarray, capacity: int) -> dict[str, np.ndarray]:
    """Feeds of one decode step: ``tokens [B]`` after rows holding ``lengths`` tokens."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
    if ids.shape[0] != lengths.shape[0]:
        raise InputError(f"decode got {ids.shape[0]} tokens for a cache of {lengths.shape[0]} rows")
    if int(lengths.max()) + 1 > capacity:
        raise InputError(f"KV buffers hold {capacity} positions; a row would need {int(lengths.max()) + 1}: "
                         "rebuild the engine with a larger --max-seq-len")
    return {"input_ids": ids, "position_ids": lengths[:, None].astype(np.int64),
            LOGITS_POSITIONS: np.zeros_like(ids)}


def chunk_feeds(tokens: Sequence[int], start: int, positions: np.ndarray, capacity: int) -> dict[str, np.ndarray]:
    """Feeds of a chunk of one sequence (scoring): ``tokens`` after ``start`` tokens, logits at ``positions``."""
    n = len(tokens)
    if n == 0 or positions.size == 0 or positions.min() < 0 or positions.max() >= n:
        raise InputError(f"run_chunk needs at least one token and positions inside the chunk of {n}, "
                         f"got {positions.tolist()[:8]}")
    if start + n > capacity:
        raise InputError(f"KV buffers hold {capacity} positions; the sequence would need {start + n}")
    return {"input_ids": np.asarray(tokens, np.int64)[None, :],
            "position_ids": np.arange(start, start + n, dtype=np.int64)[None, :],
            LOGITS_POSITIONS: np.asarray(positions, np.int64)[None, :]}
