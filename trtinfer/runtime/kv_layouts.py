"""KV layouts as strategy objects: how one engine's graph takes its KV cache, in one class per layout.

::

    layout          prompts padded   cache                                   a step's KV                 rows' length
    concat          left (mask)      grows by concatenation (new values)     past in, present out        mask columns
    shared_buffer   right            one buffer per layer, bound past=present seqlens_k / total length   lengths
    scatter_buffer  right            fixed-size buffers, TensorScatter       position_ids[:, 0]          lengths

A layout owns what differs between them: allocating a cache, the feeds of a prefill, a decode step and a chunk of
one sequence, and truncation. Sessions only bind and run (:class:`KVRunner`): the ONNX Runtime session is one, and a
layout never knows which provider runs it. The manifest's ``kv_layout`` names the layout; :func:`kv_layout` looks it
up in the registry (an unknown name is one line listing the known ones).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from trtinfer.errors import EngineLoadError, InputError
from trtinfer.runtime.kv_feeds import LOGITS_POSITIONS, chunk_feeds, decode_feeds, prefill_feeds
from trtinfer.runtime.session import KVCache


class KVRunner(Protocol):
    """What a layout needs of a session: allocate KV values and run one bound pass."""

    pad_token_id: int
    needs_positions: bool
    kv_shape: tuple[int, int]  # (kv heads, head dim)
    scatter_capacity: int  # the fixed slot count of a scatter_buffer graph (0 for the others)

    def kv_value(self, shape: tuple[int, ...]) -> Any:
        """A zeroed KV tensor of the engine's KV type on the session's device."""

    def kv_value_from(self, host: np.ndarray) -> Any:
        """A KV tensor on the session's device holding ``host`` (a copy)."""

    def new_kv(self, rows: int, positions: int) -> list[Any]:
        """One zeroed value per past input, ``[rows, kv_heads, positions, head_dim]``."""

    def run_bound(self, feeds: dict[str, np.ndarray], kv_in: list[Any], kv_out: list[Any] | None,
                  positions: np.ndarray, staging: Any) -> tuple[np.ndarray, list[Any]]:
        """One pass; logits ``[B,K,V]`` at ``positions``; ``kv_out`` None: presents are new values."""


class KVLayout(ABC):
    """One KV layout's feeds and cache handling over a :class:`KVRunner`."""

    name: ClassVar[str]
    #: whether a cache is written in place (shared and scatter buffers): truncation then only moves the length
    in_place: ClassVar[bool] = True

    def __init__(self, runner: KVRunner) -> None:
        self.runner = runner

    @abstractmethod
    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, staging: Any) -> tuple[np.ndarray, KVCache]:
        """The prompts as one padded batch into a new cache of room ``capacity``; logits ``[B, V]`` at each last."""

    @abstractmethod
    def decode(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        """One token per row (``tokens [B,1]``) after ``kv``; next-token logits ``[B, V]`` and the grown cache."""

    @abstractmethod
    def chunk(self, tokens: Sequence[int], kv: KVCache | None, capacity: int, want: np.ndarray,
              staging: Any) -> tuple[np.ndarray, KVCache]:
        """The next ``tokens`` of one sequence after ``kv`` (None: its start); logits ``[K, V]`` at ``want [1,K]``."""

    def buffer_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """The feeds (without ``logits_positions``) of a pass over rows of preallocated buffers written in place:
        row ``b``'s ``ids[b, :lengths[b]]`` go to positions ``starts[b]..`` (right padding after them). A prefill
        (``starts`` 0), a chunk of one row, or a decode step (one token a row) alike. Slot caches run on this."""
        raise EngineLoadError(f"the {self.name} KV layout has no feeds for KV rows kept in buffers")

    def truncate(self, kv: KVCache, n: int) -> KVCache:
        """A one-row cache rolled back to its first ``n`` tokens: buffer layouts only move the length (slots past
        ``n`` are masked, then overwritten)."""
        return KVCache(kv.values, np.array([n], dtype=np.int64), capacity=kv.capacity, staging=kv.staging)


_LAYOUTS: dict[str, type[KVLayout]] = {}


def register_layout(cls: type[KVLayout]) -> type[KVLayout]:
    """Class decorator: register a layout under its ``name``."""
    _LAYOUTS[cls.name] = cls
    return cls


def kv_layout(name: str, runner: KVRunner) -> KVLayout:
    """The layout named ``name`` (a manifest's ``kv_layout``) over ``runner``, or one line listing the known ones."""
    if name not in _LAYOUTS:
        raise EngineLoadError(f"KV layout '{name}' is unknown; known: {sorted(_LAYOUTS)}; rebuild the engine with "
                              "this trtinfer")
    return _LAYOUTS[name](runner)


@register_layout
class ConcatLayout(KVLayout):
    """Left-padded prompts with a 2-D attention mask; each pass returns new present tensors one column longer."""

    name = "concat"
    in_place = False

    def _run(self, feeds: dict[str, np.ndarray], past: list[Any], want: np.ndarray,
             staging: Any) -> tuple[np.ndarray, list[Any]]:
        return self.runner.run_bound(feeds, past, None, want, staging)

    def buffer_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """Rows kept in buffers, run through the concat graph: the past is ``max(starts)`` columns, each row's
        ``starts[b]`` positions right-aligned in them (gathered by the caller) and the columns before masked out,
        as left padding is; then the pass's tokens (right padding masked). A row's past ends where its new tokens
        begin, so a sliding window counted in columns (Gemma-3's local layers) sees the row's last tokens."""
        rows, width = ids.shape
        past = int(starts.max())
        mask = np.zeros((rows, past + width), dtype=np.int64)
        for r in range(rows):
            mask[r, past - starts[r]:past] = 1
            mask[r, past:past + lengths[r]] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "position_ids": starts[:, None] + np.arange(width, dtype=np.int64)}

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, staging: Any) -> tuple[np.ndarray, KVCache]:
        n, width = len(prompts), max(len(p) for p in prompts)
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        ids = np.full((n, width), self.runner.pad_token_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        for r, p in enumerate(prompts):  # left padding: every row's last token is at the same column
            ids[r, width - len(p):] = p
            mask[r, width - len(p):] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        last = np.full((n, 1), width - 1, dtype=np.int64)
        logits, vals = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                                 self.runner.new_kv(n, 0), last, staging)
        return logits[:, -1, :], KVCache(vals, lengths, mask=mask, staging=staging)

    def decode(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        assert kv.mask is not None
        mask = np.concatenate([kv.mask, np.ones((kv.batch, 1), np.int64)], axis=1)
        pos = kv.lengths[:, None].astype(np.int64)
        logits, vals = self._run({"input_ids": tokens, "attention_mask": mask, "position_ids": pos}, kv.values,
                                 np.zeros_like(tokens), kv.staging)
        return logits[:, -1, :], KVCache(vals, kv.lengths + 1, mask=mask, staging=kv.staging)

    def chunk(self, tokens: Sequence[int], kv: KVCache | None, capacity: int, want: np.ndarray,
              staging: Any) -> tuple[np.ndarray, KVCache]:
        start, n = (0 if kv is None else int(kv.lengths[0])), len(tokens)
        past = self.runner.new_kv(1, 0) if kv is None else kv.values
        # a row taken out of a batch keeps its left padding: its mask says which past columns are real
        before = np.ones((1, start), np.int64) if kv is None or kv.mask is None else kv.mask
        mask = np.concatenate([before, np.ones((1, n), np.int64)], axis=1)
        feeds = {"input_ids": np.asarray(tokens, dtype=np.int64).reshape(1, -1), "attention_mask": mask,
                 "position_ids": np.arange(start, start + n, dtype=np.int64)[None, :]}
        logits, vals = self._run(feeds, past, want, staging)
        return logits[0], KVCache(vals, np.array([start + n], dtype=np.int64), mask=mask, staging=staging)

    def truncate(self, kv: KVCache, n: int) -> KVCache:
        """The past tensors cut to ``n`` positions, through host memory."""
        assert kv.mask is not None
        keep = kv.mask.shape[1] - int(kv.lengths[0]) + n  # left padding (a row taken out of a batch) + n tokens
        cut = [self.runner.kv_value_from(np.ascontiguousarray(v.numpy()[:, :, :keep])) for v in kv.values]
        return KVCache(cut, np.array([n], dtype=np.int64), mask=kv.mask[:, :keep].copy(), staging=kv.staging)


@register_layout
class SharedBufferLayout(KVLayout):
    """Right-padded prompts, ``seqlens_k`` + ``total_sequence_length`` (GroupQueryAttention), past and present bound
    to one preallocated buffer per layer (written in place)."""

    name = "shared_buffer"

    def buffer_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        width = ids.shape[1]
        # GroupQueryAttention: seqlens_k = each row's tokens after the pass - 1; total = the widest row's
        feeds = {"input_ids": ids, "seqlens_k": (starts + lengths - 1).astype(np.int32),
                 "total_sequence_length": np.array(int(starts.max()) + width, dtype=np.int32)}
        if self.runner.needs_positions:
            feeds["position_ids"] = starts[:, None] + np.arange(width, dtype=np.int64)
        return feeds

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, staging: Any) -> tuple[np.ndarray, KVCache]:
        width = max(len(p) for p in prompts)
        cap = max(capacity, width)
        # right padding, as the scatter layout: row r's tokens sit at 0..len-1, as in its buffer
        base, lengths = prefill_feeds(prompts, self.runner.pad_token_id, cap)
        feeds = self.buffer_feeds(base["input_ids"], np.zeros_like(lengths), lengths)
        bufs = self.runner.new_kv(len(prompts), cap)
        logits, vals = self.runner.run_bound(feeds, bufs, bufs, base[LOGITS_POSITIONS], staging)
        return logits[:, -1, :], KVCache(vals, lengths, capacity=cap, staging=staging)

    def decode(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        if int(kv.lengths.max()) + 1 > kv.capacity:
            raise InputError(f"KV buffers hold {kv.capacity} positions; a row would need "
                             f"{int(kv.lengths.max()) + 1}: raise max_new_tokens' bound or the engine's max_seq_len")
        feeds = self.buffer_feeds(tokens, kv.lengths, np.ones_like(kv.lengths))
        logits, vals = self.runner.run_bound(feeds, kv.values, kv.values, np.zeros_like(tokens), kv.staging)
        return logits[:, -1, :], KVCache(vals, kv.lengths + 1, capacity=kv.capacity, staging=kv.staging)

    def chunk(self, tokens: Sequence[int], kv: KVCache | None, capacity: int, want: np.ndarray,
              staging: Any) -> tuple[np.ndarray, KVCache]:
        start, n = (0 if kv is None else int(kv.lengths[0])), len(tokens)
        cap = capacity if kv is None else kv.capacity
        if start + n > cap:
            raise InputError(f"KV buffers hold {cap} positions; the sequence would need {start + n}")
        bufs = self.runner.new_kv(1, cap) if kv is None else kv.values
        lengths = np.array([start + n], dtype=np.int64)
        feeds = self.buffer_feeds(np.asarray(tokens, dtype=np.int64).reshape(1, -1), np.array([start], np.int64),
                                  np.array([n], np.int64))
        logits, vals = self.runner.run_bound(feeds, bufs, bufs, want, staging)
        return logits[0], KVCache(vals, lengths, capacity=cap, staging=staging)


@register_layout
class ScatterBufferLayout(KVLayout):
    """The TensorRT target's graph (run here by ONNX Runtime): right padding, buffers of the graph's fixed slot count,
    each pass's KV written at ``position_ids[:, 0]`` by TensorScatter (feeds: :mod:`trtinfer.runtime.kv_feeds`)."""

    name = "scatter_buffer"

    def buffer_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        # TensorScatter writes each row's pass at position_ids[:, 0]; the causal mask comes from the positions
        return {"input_ids": ids, "position_ids": starts[:, None] + np.arange(ids.shape[1], dtype=np.int64)}

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int, staging: Any) -> tuple[np.ndarray, KVCache]:
        cap = self.runner.scatter_capacity
        feeds, lengths = prefill_feeds(prompts, self.runner.pad_token_id, cap)
        bufs = self.runner.new_kv(len(prompts), cap)
        want = feeds.pop(LOGITS_POSITIONS)
        logits, vals = self.runner.run_bound(feeds, bufs, bufs, want, staging)  # present bound to past: in place
        return logits[:, -1, :], KVCache(vals, lengths, capacity=cap, staging=staging)

    def decode(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        feeds = decode_feeds(tokens, kv.lengths, kv.capacity)
        want = feeds.pop(LOGITS_POSITIONS)
        logits, vals = self.runner.run_bound(feeds, kv.values, kv.values, want, kv.staging)
        return logits[:, -1, :], KVCache(vals, kv.lengths + 1, capacity=kv.capacity, staging=kv.staging)

    def chunk(self, tokens: Sequence[int], kv: KVCache | None, capacity: int, want: np.ndarray,
              staging: Any) -> tuple[np.ndarray, KVCache]:
        cap = self.runner.scatter_capacity
        start = 0 if kv is None else int(kv.lengths[0])
        feeds = chunk_feeds(tokens, start, want[0], cap)
        bufs = self.runner.new_kv(1, cap) if kv is None else kv.values
        logits, vals = self.runner.run_bound(feeds, bufs, bufs, feeds.pop(LOGITS_POSITIONS), staging)
        return logits[0], KVCache(vals, np.array([start + len(tokens)], dtype=np.int64), capacity=cap,
                                  staging=staging)

