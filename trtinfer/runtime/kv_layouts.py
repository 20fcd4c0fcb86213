"""KV layouts as strategy objects: how one engine's graph takes its KV cache, in one class per layout.

::

    layout          rows kept as                             a pass's KV                  a row's length given by
    concat          host rows, gathered left-aligned-right   past in, present out (new)   the 2-D attention mask
    shared_buffer   one buffer per layer, bound past=present written in place             seqlens_k / total length
    scatter_buffer  fixed-size buffers, TensorScatter        written at position_ids[:,0] position_ids

A layout owns what differs between them: the feeds of a pass over rows of KV buffers (a prefill, a chunk of one
row, a decode step alike) that give each row's length, and whether its graph writes them in place. Sessions only
bind and run; the slot cache (:mod:`trtinfer.runtime.slots`) binds rows. The manifest's ``kv_layout`` names the
layout; :func:`kv_layout` looks it up in the registry (an unknown name is one line listing the known ones).
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from trtinfer.errors import EngineLoadError


class KVLayout:
    """One KV layout's feeds, for a graph that takes ``position_ids`` or not (``needs_positions``)."""

    name: ClassVar[str]
    #: whether the graph writes the KV buffers in place (shared and scatter buffers); else (concat) the slot cache
    #: gathers each pass's past from host rows and writes the pass's new KV back
    in_place: ClassVar[bool] = True

    def __init__(self, needs_positions: bool) -> None:
        self.needs_positions = needs_positions

    def buffer_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """The feeds (without ``logits_positions``) of a pass over rows of preallocated buffers: row ``b``'s
        ``ids[b, :lengths[b]]`` go to positions ``starts[b]..`` (right padding after them). A prefill (``starts``
        0), a chunk of one row, or a decode step (one token a row) alike. Slot caches run on this."""
        feeds = {"input_ids": ids, **self.length_feeds(ids, starts, lengths)}
        if self.needs_positions:
            feeds["position_ids"] = starts[:, None] + np.arange(ids.shape[1], dtype=np.int64)
        return feeds

    def length_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """The feeds besides the ids and positions that give the graph each row's length (none: the positions do)."""
        return {}


def kv_layout(name: str, needs_positions: bool) -> KVLayout:
    """The layout named ``name`` (a manifest's ``kv_layout``), or one line listing the known ones."""
    if name not in _LAYOUTS:
        raise EngineLoadError(f"KV layout '{name}' is unknown; known: {sorted(_LAYOUTS)}; rebuild the engine with "
                              "this trtinfer")
    return _LAYOUTS[name](needs_positions)


class ConcatLayout(KVLayout):
    """Left-padded prompts with a 2-D attention mask; each pass returns new present tensors one column longer."""

    name = "concat"
    in_place = False

    def length_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        """Rows kept in buffers, run through the concat graph: the past is ``max(starts)`` columns, each row's
        ``starts[b]`` positions right-aligned in them (gathered by the caller) and the columns before masked out,
        as left padding is; then the pass's tokens (right padding masked). A row's past ends where its new tokens
        begin, so a sliding window counted in columns (Gemma-3's local layers) sees the row's last tokens."""
        past = int(starts.max())
        cols = np.arange(past + ids.shape[1])
        mask = (cols >= past - starts[:, None]) & (cols < past + lengths[:, None])
        return {"attention_mask": mask.astype(np.int64)}


class SharedBufferLayout(KVLayout):
    """Right-padded prompts, ``seqlens_k`` + ``total_sequence_length`` (GroupQueryAttention), past and present bound
    to one preallocated buffer per layer (written in place)."""

    name = "shared_buffer"

    def length_feeds(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> dict[str, np.ndarray]:
        # GroupQueryAttention: seqlens_k = each row's tokens after the pass - 1; total = the widest row's
        return {"seqlens_k": (starts + lengths - 1).astype(np.int32),
                "total_sequence_length": np.array(int(starts.max()) + ids.shape[1], dtype=np.int32)}


class ScatterBufferLayout(KVLayout):
    """The TensorRT target's graph (run here by ONNX Runtime): right padding, buffers of the graph's fixed slot count,
    each pass's KV written at ``position_ids[:, 0]`` by TensorScatter; the graph masks slot ``j`` for query position
    ``p`` unless ``j <= p``, so a short row's padding writes slots its next pass overwrites before anything reads them."""

    name = "scatter_buffer"


#: the layouts by ``name`` (the manifest's ``kv_layout``)
_LAYOUTS: dict[str, type[KVLayout]] = {c.name: c for c in (ConcatLayout, SharedBufferLayout, ScatterBufferLayout)}
