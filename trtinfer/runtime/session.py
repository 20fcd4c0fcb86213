"""Backend sessions behind one interface: the generator drives a :class:`DecoderSession` and never knows which.

A session runs the decoder graph on host-side ``input_ids/attention_mask/position_ids`` and an opaque
:class:`KVCache` (backend values that stay where the backend keeps them) and returns last-position logits as numpy.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.errors import BackendUnavailableError, EngineLoadError, InputError
from trtinfer.runtime.config import RuntimeConfig
from trtinfer.runtime.manifest import Manifest

log = logging.getLogger(__name__)


class KVCache:
    """Per-layer key/value tensors owned by a backend, in graph-input order; ``length`` = cached positions."""

    def __init__(self, values: list[Any], batch: int, length: int) -> None:
        self.values = values
        self.batch = batch
        self.length = length


class DecoderSession(ABC):
    """The one interface every backend implements. Use as a context manager."""

    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
        self.engine_dir = engine_dir
        self.manifest = manifest
        self.config = config
        io = manifest.raw["io"]
        self.input_names = [t["name"] for t in io["inputs"]]
        self.output_names = [t["name"] for t in io["outputs"]]
        self.past_names = [n for n in self.input_names if n.startswith("past_key_values.")]
        self.present_names = [n for n in self.output_names if n.startswith("present.")]

    def __enter__(self) -> DecoderSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release backend resources."""

    def check_inputs(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                     kv: KVCache) -> None:
        """Check dtypes and shapes against the graph contract; say expected vs got."""
        b, s = input_ids.shape
        expected = {"input_ids": (b, s), "attention_mask": (b, kv.length + s), "position_ids": (b, s)}
        for name, arr in (("input_ids", input_ids), ("attention_mask", attention_mask), ("position_ids", position_ids)):
            if arr.dtype != np.int64:
                raise InputError(f"{name} must be int64, got {arr.dtype}")
            if arr.shape != expected[name]:
                raise InputError(f"{name} must have shape {expected[name]}, got {arr.shape}")
        if kv.batch != b:
            raise InputError(f"KV cache holds batch {kv.batch}, inputs have batch {b}")

    @abstractmethod
    def empty_cache(self, batch: int) -> KVCache:
        """A KV cache with zero cached positions for ``batch`` rows."""

    @abstractmethod
    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            kv: KVCache) -> tuple[np.ndarray, KVCache]:
        """One forward pass; returns logits ``[B, V]`` of the last position and the grown cache."""

    @abstractmethod
    def select_rows(self, kv: KVCache, rows: Sequence[int]) -> KVCache:
        """Keep only ``rows`` of the cache (finished rows leave the batch), without a trip through numpy."""


_BACKENDS: dict[str, Callable[[Path, Manifest, RuntimeConfig], DecoderSession]] = {}


def register_backend(name: str) -> Callable[[Any], Any]:
    """Class decorator: register a session class for engines whose manifest names ``name``."""

    def deco(cls: Any) -> Any:
        _BACKENDS[name] = cls
        return cls

    return deco


def open_session(engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> DecoderSession:
    """Open the session for the engine's backend, or raise listing the known ones."""
    if manifest.backend not in _BACKENDS:
        raise EngineLoadError(f"engine backend '{manifest.backend}' is unknown; known: {sorted(_BACKENDS)}")
    return _BACKENDS[manifest.backend](engine_dir, manifest, config)


@register_backend("onnxruntime")
class OrtDecoderSession(DecoderSession):
    """ONNX Runtime with IOBinding: KV stays in OrtValues (on the device for CUDA) from step to step."""

    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
        super().__init__(engine_dir, manifest, config)
        import onnxruntime as ort

        self._ort = ort
        so = ort.SessionOptions()
        # the graph was optimized offline at build time for this target: do not redo it on every load
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.intra_op_num_threads = config.intra_op_threads
        so.log_severity_level = 3
        if config.provider == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BackendUnavailableError(
                    "provider 'cuda' needs onnxruntime-gpu with CUDAExecutionProvider; this onnxruntime offers "
                    f"{ort.get_available_providers()}; install 'trtinfer[gpu]' or use provider 'cpu'"
                )
            providers: list[Any] = [("CUDAExecutionProvider", {"device_id": config.device_id}), "CPUExecutionProvider"]
            self.device = "cuda"
        else:
            providers = ["CPUExecutionProvider"]
            self.device = "cpu"
        model = engine_dir / manifest.files["decoder"]
        try:
            self.sess = ort.InferenceSession(str(model), so, providers=providers)
        except Exception as e:
            raise EngineLoadError(f"ONNX Runtime could not load {model}: {e}") from e
        got = [i.name for i in self.sess.get_inputs()]
        if got != self.input_names:
            raise EngineLoadError(f"{model} inputs {got[:4]}... differ from the manifest's; rebuild the engine")
        select = engine_dir / manifest.files["kv_select"]
        self.select_sess = ort.InferenceSession(str(select), so, providers=providers)
        geo = manifest.geometry
        self._kv_shape = (geo["num_kv_heads"], geo["head_dim"])
        self._pinned: dict[tuple[str, tuple[int, ...]], Any] = {}

    # --- host buffers -------------------------------------------------------------------------------------
    def _bind_host_input(self, io: Any, name: str, arr: np.ndarray) -> None:
        if self.device == "cpu":
            io.bind_cpu_input(name, arr)
            return
        # CUDA: copy through a page-locked staging buffer so the H2D copy is a true DMA (unexecuted here)
        buf = self._pinned_buffer(name, arr.shape, arr.dtype)
        buf[...] = arr
        io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), buf.ctypes.data)

    def _pinned_buffer(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        key = (name, tuple(shape))
        if key not in self._pinned:
            import torch  # GPU path only: torch's allocator gives page-locked host memory

            t = torch.empty(shape, dtype=torch.from_numpy(np.empty(0, dtype)).dtype, pin_memory=True)
            self._pinned[key] = (t, t.numpy())
        return self._pinned[key][1]  # type: ignore[no-any-return]

    # --- interface ------------------------------------------------------------------------------------------
    def empty_cache(self, batch: int) -> KVCache:
        kv, hd = self._kv_shape
        zero = np.zeros((batch, kv, 0, hd), np.float32)
        vals = [self._ort.OrtValue.ortvalue_from_numpy(zero, self.device, self.config.device_id)
                for _ in self.past_names]
        return KVCache(vals, batch, 0)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            kv: KVCache) -> tuple[np.ndarray, KVCache]:
        self.check_inputs(input_ids, attention_mask, position_ids, kv)
        io = self.sess.io_binding()
        self._bind_host_input(io, "input_ids", input_ids)
        self._bind_host_input(io, "attention_mask", attention_mask)
        self._bind_host_input(io, "position_ids", position_ids)
        for name, val in zip(self.past_names, kv.values):
            io.bind_ortvalue_input(name, val)
        io.bind_output("logits", "cpu")
        for name in self.present_names:
            io.bind_output(name, self.device, self.config.device_id)
        self.sess.run_with_iobinding(io)
        outs = io.get_outputs()
        logits = outs[0].numpy()
        return logits[:, -1, :], KVCache(list(outs[1:]), kv.batch, kv.length + input_ids.shape[1])

    def select_rows(self, kv: KVCache, rows: Sequence[int]) -> KVCache:
        io = self.select_sess.io_binding()
        io.bind_cpu_input("rows", np.asarray(rows, dtype=np.int64))
        for i, val in enumerate(kv.values):
            io.bind_ortvalue_input(f"kv.{i}", val)
            io.bind_output(f"out.{i}", self.device, self.config.device_id)
        self.select_sess.run_with_iobinding(io)
        return KVCache(list(io.get_outputs()), len(rows), kv.length)
