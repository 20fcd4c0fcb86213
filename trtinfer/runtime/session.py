"""Backend sessions behind one interface: the slot cache (:mod:`trtinfer.runtime.slots`) drives a
:class:`DecoderSession` and never knows which.

This module is the interface and the backend registry; ONNX Runtime's session is :mod:`trtinfer.runtime.ort_session`
(its environment :mod:`trtinfer.runtime.ort_env`, its KV layouts :mod:`trtinfer.runtime.kv_layouts`), TensorRT's
:mod:`trtinfer.runtime.trt_session`; both load when an engine names them.

A session allocates KV buffers whose rows are sequences (on the device for CUDA), runs one pass over a run of those
rows in place, copies rows, and returns the logits as numpy. What goes into a pass (padding, masks, positions) is
the engine's KV layout's business; which rows run together is the slot cache's; everything else (scoring, contexts,
generation, the server) runs on slot caches.

Engines built since scoring exist take ``logits_positions [B,K]``: the positions of each row whose hidden states
go through the LM head. Generation asks for one per row (the LM head costs what it did when the graph kept the last
position only); scoring asks for every position of a chunk.
"""
from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trtinfer.artifact import DTYPE_BYTES, PRESENT_PREFIX, Manifest
from trtinfer.errors import EngineLoadError, InputError
from trtinfer.runtime.config import RuntimeConfig
from trtinfer.runtime.kv_layouts import kv_layout

#: graph input ``[B,K]`` int64: the positions whose logits the graph computes
LOGITS_POSITIONS = "logits_positions"

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11


class Closing:
    """A context manager whose exit calls :meth:`close` (sessions, engines)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release backend resources."""


class DecoderSession(Closing, ABC):
    """The one interface every backend implements (KV rows, a pass over rows, row copies). Use as a context
    manager."""

    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
        self.engine_dir = engine_dir
        self.manifest = manifest
        self.config = config
        io = manifest.io
        self.input_names = io.input_names
        self.past_names = [t.name for t in io.past]
        self.present_names = [n for n in io.output_names if n.startswith(PRESENT_PREFIX)]
        self.kv_layout = manifest.kv_layout
        self.has_logits_positions = LOGITS_POSITIONS in self.input_names
        logits, mode = io.output("logits"), manifest.export_logits
        # graphs exported with logits="all" return every position too (no logits_positions input needed); the export's
        # record says which, else the graph's shape
        self.logits_every_position = self.has_logits_positions or (
            mode == "all" if mode is not None else
            logits is not None and len(logits.shape) == 3 and logits.shape[1] != 1)
        geo = manifest.geometry
        self.kv_shape: tuple[int, int] = (int(geo["num_kv_heads"]), int(geo["head_dim"]))
        self.kv_dtype = io.kv_dtype  # float16/bfloat16 in fp16/bf16 engines
        self.needs_positions = "position_ids" in self.input_names
        # scatter_buffer graphs fix their KV slot count (TensorRT needs it static): every buffer has exactly that many
        past = io.past
        self.scatter_capacity = int(past[0].shape[2]) if past and isinstance(past[0].shape[2], int) else 0
        self.layout = kv_layout(self.kv_layout, self.needs_positions)

    # --- KV rows, as a :class:`~trtinfer.runtime.slots.SlotCache` uses them ----------------------------------
    @abstractmethod
    def slot_values(self, slots: int, capacity: int) -> list[Any]:
        """One zeroed ``[slots, kv_heads, capacity, head_dim]`` KV buffer per past input, on the backend's device."""

    def kv_row_bytes(self, capacity: int) -> int:
        """Bytes of one row of a :meth:`slot_values` buffer (rows are contiguous: row r starts at r * this)."""
        kvh, hd = self.kv_shape
        return kvh * capacity * hd * DTYPE_BYTES[self.kv_dtype]

    @staticmethod
    def row_pointer(value: Any) -> int:
        """The device (or host) address of a :meth:`slot_values` buffer."""
        return int(value.data_ptr())

    @abstractmethod
    def copy_rows(self, values: list[Any], src: int, into: list[Any], dst: int, n: int, capacity: int) -> None:
        """Row ``dst`` of the ``into`` buffers gets the first ``n`` positions of row ``src`` of ``values`` (both
        :meth:`slot_values` of this session and ``capacity``), on the backend's device (a prefix cache hit on a row
        still in use, a forked context)."""

    def copy_rows_on_device(self, values: list[Any], src: int, into: list[Any], dst: int, n: int, capacity: int,
                            stream: Any = None) -> None:
        """:meth:`copy_rows` on a CUDA device: one 2-D device-to-device copy per buffer (``kv_heads`` runs of ``n``
        positions), queued on ``stream`` (None: complete on return,
        :func:`~trtinfer.runtime.cuda.copy_2d_on_device`)."""
        from trtinfer.runtime import cuda  # cuda-python: the GPU extra's, never imported on the CPU path

        kvh, row = self.kv_shape[0], self.kv_row_bytes(capacity)
        pitch = row // kvh
        cuda.set_device(self.config.device_id)
        for val, out in zip(values, into):
            cuda.copy_2d_on_device(self.row_pointer(out) + dst * row, pitch, self.row_pointer(val) + src * row, pitch,
                                   n * (pitch // capacity), kvh, stream)

    @abstractmethod
    def run_rows(self, feeds: dict[str, np.ndarray], values: list[Any], first_row: int, rows: int, capacity: int,
                 positions: np.ndarray, staging: Any, bindings: dict[Any, Any] | None = None) -> np.ndarray:
        """One pass over rows ``first_row .. first_row + rows - 1`` of ``values`` (read and written in place);
        ``feeds`` are the layout's :meth:`~trtinfer.runtime.kv_layouts.KVLayout.buffer_feeds`; logits
        ``[rows, K, V]`` at ``positions [rows, K]``. ``bindings``: the caller's (one thread's, one set of
        ``values``') dict where a backend may keep what it bound for a row range, to reuse on the next pass."""

    def position_feeds(self, feeds: dict[str, np.ndarray], positions: np.ndarray) -> dict[str, np.ndarray]:
        """``feeds`` plus ``logits_positions`` (``positions``), where the graph takes that input."""
        if not self.has_logits_positions:
            return feeds
        return {**feeds, LOGITS_POSITIONS: np.ascontiguousarray(positions, dtype=np.int64)}

    def decoder_graph(self) -> contextlib.AbstractContextManager[None]:
        """Within this block, passes of this thread run on the decoder graph even where the engine has a prefill graph
        (a draft's verification must score its tokens as the decode steps they stand for); a no-op for backends
        with one graph."""
        return contextlib.nullcontext()

    def check_can_score(self) -> None:
        """Raise :class:`InputError` when the engine returns last-position logits only (built before scoring)."""
        if not self.logits_every_position:
            raise InputError(f"the graph in {self.engine_dir} computes logits at the last position only (no "
                             f"{LOGITS_POSITIONS} input: an engine built by an older trtinfer or with that pass "
                             "disabled, or an export stage); rebuild the engine (or score the optimize stage) to score "
                             "sequences")

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
