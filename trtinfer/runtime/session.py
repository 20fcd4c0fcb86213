"""Backend sessions behind one interface: the generator drives a :class:`DecoderSession` and never knows which.

A session turns prompts and next tokens into the graph's inputs for the engine's KV layout, keeps the KV cache as
backend values (on the device for CUDA) in an opaque :class:`KVCache`, and returns next-token logits as numpy.
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
from trtinfer.runtime.manifest import Manifest, kv_dtype

log = logging.getLogger(__name__)


class KVCache:
    """Per-layer key/value tensors owned by a backend, in graph-input order, and how many tokens each row holds.

    ``lengths[b]`` counts row ``b``'s real tokens (prompt + generated so far). ``mask`` is the growing 2D padding
    mask of the concat layout (None for shared buffers); ``capacity`` is the shared buffers' length (0 for concat).
    """

    def __init__(self, values: list[Any], lengths: np.ndarray, mask: np.ndarray | None = None,
                 capacity: int = 0) -> None:
        self.values = values
        self.lengths = lengths
        self.mask = mask
        self.capacity = capacity

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
        io = manifest.raw["io"]
        self.input_names = [t["name"] for t in io["inputs"]]
        self.output_names = [t["name"] for t in io["outputs"]]
        self.past_names = [n for n in self.input_names if n.startswith("past_key_values.")]
        self.present_names = [n for n in self.output_names if n.startswith("present.")]
        self.kv_layout = str(manifest.raw.get("kv_layout", "concat"))
        self.pad_token_id = int(manifest.raw.get("tokenizer", {}).get("pad_token_id") or 0)

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
        self._kv_dtype = kv_dtype(manifest.raw["io"])  # float16/bfloat16 in fp16/bf16 engines
        self._needs_positions = "position_ids" in self.input_names
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
    def _kv_value(self, shape: tuple[int, ...]) -> Any:
        """A zeroed KV tensor of the engine's KV type (zeros: unused buffer slots are read as 0 * x, never NaN)."""
        ov = self._ort.OrtValue
        if self._kv_dtype != "bfloat16":
            return ov.ortvalue_from_numpy(np.zeros(shape, self._kv_dtype), self.device, self.config.device_id)
        zeros = np.zeros(shape, np.uint16)  # bf16 zero is the all-zero bit pattern; numpy has no bfloat16
        if self.device == "cpu":
            return ov.ortvalue_from_numpy_with_onnx_type(zeros, 16)
        val = ov.ortvalue_from_shape_and_type(list(shape), 16, self.device, self.config.device_id)
        val.update_inplace(zeros)  # unexecuted here: no GPU in this project's CI
        return val

    def _run(self, feeds: dict[str, np.ndarray], kv_in: list[Any], kv_out: list[Any] | None) -> tuple[np.ndarray, list[Any]]:
        """One forward pass. ``kv_out`` None: presents are new values (concat); else bound in place (shared)."""
        io = self.sess.io_binding()
        for name, arr in feeds.items():
            self._bind_host_input(io, name, arr)
        for name, val in zip(self.past_names, kv_in):
            io.bind_ortvalue_input(name, val)
        io.bind_output("logits", "cpu")
        for i, name in enumerate(self.present_names):
            if kv_out is None:
                io.bind_output(name, self.device, self.config.device_id)
            else:
                io.bind_ortvalue_output(name, kv_out[i])
        self.sess.run_with_iobinding(io)
        outs = io.get_outputs()
        logits = outs[0].numpy()
        return logits[:, -1, :], (list(outs[1:]) if kv_out is None else kv_out)

    def prefill(self, prompts: Sequence[Sequence[int]], capacity: int) -> tuple[np.ndarray, KVCache]:
        n, width = len(prompts), max(len(p) for p in prompts)
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        ids = np.full((n, width), self.pad_token_id, dtype=np.int64)
        kvh, hd = self._kv_shape
        if self.kv_layout == "shared_buffer":
            for r, p in enumerate(prompts):  # right padding: row r's tokens sit at 0..len-1, as in its buffer
                ids[r, :len(p)] = p
            cap = max(capacity, width)
            bufs = [self._kv_value((n, kvh, cap, hd)) for _ in self.past_names]
            feeds: dict[str, np.ndarray] = {"input_ids": ids, "seqlens_k": (lengths - 1).astype(np.int32),
                     "total_sequence_length": np.array(width, dtype=np.int32)}
            if self._needs_positions:
                feeds["position_ids"] = np.broadcast_to(np.arange(width, dtype=np.int64), (n, width)).copy()
            logits, vals = self._run(feeds, bufs, bufs)
            return logits, KVCache(vals, lengths, capacity=cap)
        mask = np.zeros((n, width), dtype=np.int64)
        for r, p in enumerate(prompts):  # left padding: every row's last token is at the same column
            ids[r, width - len(p):] = p
            mask[r, width - len(p):] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        empty = [self._kv_value((n, kvh, 0, hd)) for _ in self.past_names]
        logits, vals = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, empty, None)
        return logits, KVCache(vals, lengths, mask=mask)

    def decode(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        if tokens.shape[0] != kv.batch:
            raise InputError(f"decode got {tokens.shape[0]} tokens for a cache of {kv.batch} rows")
        pos = kv.lengths[:, None].astype(np.int64)
        if self.kv_layout == "shared_buffer":
            if int(kv.lengths.max()) + 1 > kv.capacity:
                raise InputError(f"KV buffers hold {kv.capacity} positions; a row would need "
                                 f"{int(kv.lengths.max()) + 1}: raise max_new_tokens' bound or the engine's max_seq_len")
            feeds: dict[str, np.ndarray] = {"input_ids": tokens, "seqlens_k": kv.lengths.astype(np.int32),
                     "total_sequence_length": np.array(int(kv.lengths.max()) + 1, dtype=np.int32)}
            if self._needs_positions:
                feeds["position_ids"] = pos
            logits, vals = self._run(feeds, kv.values, kv.values)
            return logits, KVCache(vals, kv.lengths + 1, capacity=kv.capacity)
        assert kv.mask is not None
        mask = np.concatenate([kv.mask, np.ones((kv.batch, 1), np.int64)], axis=1)
        logits, vals = self._run({"input_ids": tokens, "attention_mask": mask, "position_ids": pos}, kv.values, None)
        return logits, KVCache(vals, kv.lengths + 1, mask=mask)

    def select_rows(self, kv: KVCache, rows: Sequence[int]) -> KVCache:
        io = self.select_sess.io_binding()
        io.bind_cpu_input("rows", np.asarray(rows, dtype=np.int64))
        for i, val in enumerate(kv.values):
            io.bind_ortvalue_input(f"kv.{i}", val)
            io.bind_output(f"out.{i}", self.device, self.config.device_id)
        self.select_sess.run_with_iobinding(io)
        idx = list(rows)
        return KVCache(list(io.get_outputs()), kv.lengths[idx], None if kv.mask is None else kv.mask[idx],
                       kv.capacity)
