"""Backend sessions behind one interface: the generator drives a :class:`DecoderSession` and never knows which.

This module is the interface, the :class:`KVCache` handle and the backend registry; ONNX Runtime's session is
:mod:`trtinfer.runtime.ort_session` (its environment :mod:`trtinfer.runtime.ort_env`, its KV layouts
:mod:`trtinfer.runtime.kv_layouts`), TensorRT's :mod:`trtinfer.runtime.trt_session`; both load when an engine names
them.

A session turns prompts and next tokens into the graph's inputs for the engine's KV layout, keeps the KV cache as
backend values (on the device for CUDA) in an opaque :class:`KVCache`, and returns next-token logits as numpy.

Engines built since scoring exist take ``logits_positions [B,K]``: the positions of each row whose hidden states
go through the LM head. Generation asks for one per row (the LM head costs what it did when the graph kept the last
position only); :meth:`DecoderSession.run_chunk` asks for every position of a chunk, which scoring needs.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import PRESENT_PREFIX, Manifest
from trtinfer.errors import EngineLoadError, InputError
from trtinfer.runtime.config import RuntimeConfig

# LOGITS_POSITIONS: graph input [B,K] int64, the positions whose logits the graph computes
from trtinfer.runtime.kv_feeds import LOGITS_POSITIONS

log = logging.getLogger(__name__)


class KVCache:
    """Per-layer key/value tensors owned by a backend, in graph-input order, and how many tokens each row holds.

    ``lengths[b]`` counts row ``b``'s real tokens (prompt + generated so far). ``mask`` is the growing 2D padding
    mask of the concat layout (None for shared buffers); ``capacity`` is the shared buffers' length (0 for concat).

    A cache belongs to one generation (or one scored sequence): the one :meth:`DecoderSession.prefill` (or the first
    :meth:`DecoderSession.run_chunk`) made, and every cache derived from it by ``decode``, ``select_rows`` or the
    next chunk. ``staging`` is that generation's host staging, if its backend has one (:class:`PinnedInputs` on CUDA,
    None on the CPU): created with the first cache, handed on to each derived one, and freed with the last of them,
    so two generations never share a host buffer. Drive one generation from one thread at a time; different
    generations may run on one session from different threads.
    """

    def __init__(self, values: list[Any], lengths: np.ndarray, mask: np.ndarray | None = None,
                 capacity: int = 0, staging: Any = None) -> None:
        self.values = values
        self.lengths = lengths
        self.mask = mask
        self.capacity = capacity
        self.staging = staging

    @property
    def batch(self) -> int:
        """Rows in the cache."""
        return int(self.lengths.shape[0])


class DecoderSession(ABC):
    """The one interface every backend implements. Use as a context manager.

    The generator calls :meth:`prefill` once with the prompts, then :meth:`decode` with one token per row; how
    prompts are padded and how the KV cache grows is the session's business (it follows the engine's KV layout:
    ``concat`` = left padding + attention mask, cache grows by concatenation; ``shared_buffer`` = right padding +
    ``seqlens_k``, past and present bound to one preallocated buffer).
    """

    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
        self.engine_dir = engine_dir
        self.manifest = manifest
        self.config = config
        io = manifest.io
        self.input_names = io.input_names
        self.output_names = io.output_names
        self.past_names = [t.name for t in io.past]
        self.present_names = [n for n in self.output_names if n.startswith(PRESENT_PREFIX)]
        self.kv_layout = manifest.kv_layout
        self.pad_token_id = manifest.pad_token_id
        self.has_logits_positions = LOGITS_POSITIONS in self.input_names
        logits = io.output("logits")
        # graphs exported with logits="all" return every position too (no logits_positions input needed)
        self.logits_every_position = self.has_logits_positions or (
            logits is not None and len(logits.shape) == 3 and logits.shape[1] != 1)

    def __enter__(self) -> DecoderSession:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release backend resources."""

    @abstractmethod
    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int) -> tuple[np.ndarray, KVCache]:
        """Run the prompts as one padded batch; ``capacity`` bounds prompt + new tokens. Returns logits ``[B, V]``."""

    @abstractmethod
    def decode(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        """Feed one token per row (``tokens [B]``); returns next-token logits ``[B, V]`` and the updated cache."""

    @abstractmethod
    def select_rows(self, kv: KVCache, rows: Sequence[int]) -> KVCache:
        """Keep only ``rows`` of the cache (finished rows leave the batch), without a trip through numpy."""

    def prefill_greedy(self, prompts: Sequence[Sequence[int]], capacity: int) -> tuple[np.ndarray, KVCache]:
        """:meth:`prefill`, returning each row's argmax token ``[B]`` instead of logits (plain greedy decoding).

        Backends that compute the argmax on the device (TensorRT) override this so only token ids cross the bus.
        """
        logits, kv = self.prefill(prompts, capacity)
        return logits.argmax(axis=-1).astype(np.int64), kv

    def decode_greedy(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        """:meth:`decode`, returning each row's argmax token ``[B]`` instead of logits."""
        logits, kv = self.decode(tokens, kv)
        return logits.argmax(axis=-1).astype(np.int64), kv

    def run_chunk(self, tokens: Sequence[int], kv: KVCache | None, capacity: int,
                  positions: Sequence[int] | None = None) -> tuple[np.ndarray, KVCache]:
        """Feed the next ``tokens`` of one sequence after ``kv`` (None: its start); returns logits ``[K, V]``.

        The logits are those at ``positions`` of the chunk (default: every position; position ``j`` predicts the
        token after ``tokens[j]``) and the cache now holding the chunk too. ``capacity`` bounds the sequence's whole
        length (shared KV buffers are allocated for it on the first chunk). Batch 1: scoring runs one sequence at a
        time.
        """
        raise EngineLoadError(f"the {type(self).__name__} backend cannot run chunks of a sequence (scoring)")

    # --- slot rows: the scheduler's KV cache (:class:`~trtinfer.runtime.slots.SlotCache`) ---------------------
    def slot_values(self, slots: int, capacity: int) -> list[Any]:
        """One zeroed ``[slots, kv_heads, capacity, head_dim]`` KV buffer per past input, on the backend's device."""
        raise EngineLoadError(f"the {type(self).__name__} backend keeps no KV rows for continuous batching")

    def kv_row_bytes(self, capacity: int) -> int:
        """Bytes of one row of a :meth:`slot_values` buffer (rows are contiguous: row r starts at r * this)."""
        raise EngineLoadError(f"the {type(self).__name__} backend keeps no KV rows for continuous batching")

    @staticmethod
    def row_pointer(value: Any) -> int:
        """The device (or host) address of a :meth:`slot_values` buffer."""
        return int(value.data_ptr())

    def copy_rows(self, values: list[Any], src: int, dst: int, n: int, capacity: int) -> None:
        """Row ``dst``'s first ``n`` positions become row ``src``'s, in every :meth:`slot_values` buffer, on the
        backend's device (a prefix cache hit on a row still in use)."""
        raise EngineLoadError(f"the {type(self).__name__} backend cannot copy KV rows")

    def run_rows(self, feeds: dict[str, np.ndarray], values: list[Any], first_row: int, rows: int, capacity: int,
                 positions: np.ndarray, staging: Any, bindings: dict[Any, Any] | None = None) -> np.ndarray:
        """One pass over rows ``first_row .. first_row + rows - 1`` of ``values`` (read and written in place);
        ``feeds`` are the layout's :meth:`~trtinfer.runtime.kv_layouts.KVLayout.buffer_feeds`; logits
        ``[rows, K, V]`` at ``positions [rows, K]``. ``bindings``: the caller's (one thread's, one set of
        ``values``') dict where a backend may keep what it bound for a row range, to reuse on the next pass."""
        raise EngineLoadError(f"the {type(self).__name__} backend keeps no KV rows for continuous batching")

    def copy_cache(self, kv: KVCache) -> KVCache:
        """An independent copy of a one-row cache (a forked context), made on the backend's device."""
        raise EngineLoadError(f"the {type(self).__name__} backend cannot copy a KV cache")

    def truncate_cache(self, kv: KVCache, n: int) -> KVCache:
        """The cache of a one-row sequence rolled back to its first ``n`` tokens."""
        raise EngineLoadError(f"the {type(self).__name__} backend cannot truncate a KV cache")

    def decoder_graph(self) -> contextlib.AbstractContextManager[None]:
        """Within this block, passes of this thread run on the decoder graph even where the engine has a prefill graph
        (a draft's verification must score its tokens as the decode steps they stand for); a no-op for backends
        with one graph."""
        return contextlib.nullcontext()

    def check_can_score(self) -> None:
        """Raise :class:`InputError` when the engine returns last-position logits only (built before scoring)."""
        if not self.logits_every_position:
            raise InputError(f"the graph in {self.engine_dir} computes logits at the last position only (no "
                             f"{LOGITS_POSITIONS} input: an engine built by an older trtinfer or with that pass disabled, or an "
                             "export stage); "
                             "rebuild the engine (or score the optimize stage) to score sequences")

    def select(self, logits: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The graph's logits ``[B,K',V]`` -> those at ``positions [B,K]``.

        With the ``logits_positions`` input the graph already gathered them; a last-position-only graph chose its
        own (generation's) position; an every-position graph is indexed here.
        """
        if self.has_logits_positions or logits.shape[1] == 1:
            return logits
        return np.take_along_axis(logits, positions[:, :, None], axis=1)


_BACKENDS: dict[str, Callable[[Path, Manifest, RuntimeConfig], DecoderSession]] = {}
_LAZY_BACKENDS = {"onnxruntime": "trtinfer.runtime.ort_session",
                  "tensorrt": "trtinfer.runtime.trt_session"}  # imported when an engine needs them


def register_backend(name: str) -> Callable[[Any], Any]:
    """Class decorator: register a session class for engines whose manifest names ``name``."""

    def deco(cls: Any) -> Any:
        _BACKENDS[name] = cls
        return cls

    return deco


def open_session(engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> DecoderSession:
    """Open the session for the engine's backend, or raise listing the known ones."""
    if manifest.backend not in _BACKENDS and manifest.backend in _LAZY_BACKENDS:
        importlib.import_module(_LAZY_BACKENDS[manifest.backend])  # registers it
    if manifest.backend not in _BACKENDS:
        raise EngineLoadError(f"engine backend '{manifest.backend}' is unknown; known: "
                              f"{sorted({*_BACKENDS, *_LAZY_BACKENDS})}")
    return _BACKENDS[manifest.backend](engine_dir, manifest, config)
