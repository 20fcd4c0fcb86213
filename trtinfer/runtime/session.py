"""Backend sessions behind one interface: the generator drives a :class:`DecoderSession` and never knows which.

A session turns prompts and next tokens into the graph's inputs for the engine's KV layout, keeps the KV cache as
backend values (on the device for CUDA) in an opaque :class:`KVCache`, and returns next-token logits as numpy.

Engines built since scoring exist take ``logits_positions [B,K]``: the positions of each row whose hidden states
go through the LM head. Generation asks for one per row (the LM head costs what it did when the graph kept the last
position only); :meth:`DecoderSession.run_chunk` asks for every position of a chunk, which scoring needs.
"""
from __future__ import annotations

import contextlib
import ctypes
import io as _io
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

LOGITS_POSITIONS = "logits_positions"  # graph input [B,K] int64: positions whose logits the graph computes


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
        self.has_logits_positions = LOGITS_POSITIONS in self.input_names
        logits: dict[str, Any] = next((t for t in io["outputs"] if t["name"] == "logits"), {"shape": []})
        # graphs exported with logits="all" return every position too (no logits_positions input needed)
        self.logits_every_position = self.has_logits_positions or (
            len(logits["shape"]) == 3 and logits["shape"][1] != 1)

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

    def run_chunk(self, tokens: Sequence[int], kv: KVCache | None, capacity: int,
                  positions: Sequence[int] | None = None) -> tuple[np.ndarray, KVCache]:
        """Feed the next ``tokens`` of one sequence after ``kv`` (None: its start); returns logits ``[K, V]``.

        The logits are those at ``positions`` of the chunk (default: every position; position ``j`` predicts the
        token after ``tokens[j]``) and the cache now holding the chunk too. ``capacity`` bounds the sequence's whole
        length (shared KV buffers are allocated for it on the first chunk). Batch 1: scoring runs one sequence at a
        time.
        """
        raise EngineLoadError(f"the {type(self).__name__} backend cannot run chunks of a sequence (scoring)")

    def check_can_score(self) -> None:
        """Raise :class:`InputError` when the engine returns last-position logits only (built before scoring)."""
        if not self.logits_every_position:
            raise InputError(f"the graph in {self.engine_dir} computes logits at the last position only (no "
                             f"{LOGITS_POSITIONS} input: an engine built by an older trtinfer or with that pass disabled, or an "
                             "export stage); "
                             "rebuild the engine (or score the optimize stage) to score sequences")

    def _select(self, logits: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The graph's logits ``[B,K',V]`` -> those at ``positions [B,K]``.

        With the ``logits_positions`` input the graph already gathered them; a last-position-only graph chose its
        own (generation's) position; an every-position graph is indexed here.
        """
        if self.has_logits_positions or logits.shape[1] == 1:
            return logits
        return np.take_along_axis(logits, positions[:, :, None], axis=1)


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


def _preload_cuda_libraries(ort: Any) -> None:
    """Load CUDA/cuDNN from the nvidia-* pip packages (``onnxruntime-gpu[cuda,cudnn]``) before the CUDA provider.

    Where the libraries are on the loader's path anyway this changes nothing; ONNX Runtime prints what it could not
    load, which goes to the debug log instead of stdout (a missing library surfaces as the provider failing to start).
    """
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is None:
        return
    out = _io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            preload()
        except (RuntimeError, OSError) as e:  # a broken nvidia-* install: the provider check says it more clearly
            log.debug("onnxruntime.preload_dlls failed: %s", e)
    if out.getvalue().strip():
        log.debug("onnxruntime.preload_dlls: %s", out.getvalue().strip())


def _pinned_memory_info(ort: Any, device_id: int) -> Any:
    """The OrtMemoryInfo of ONNX Runtime's page-locked host memory for CUDA device ``device_id``, or None.

    ONNX Runtime (>= 1.23) hands out its CUDA provider's allocators through the provider's EP devices; the classic
    onnxruntime-gpu wheel lists none until its provider library is registered as a plugin, which is done once here.
    """
    if not all(hasattr(ort, n) for n in ("get_ep_devices", "OrtDeviceMemoryType", "register_execution_provider_library")):
        return None
    cuda = [d for d in ort.get_ep_devices() if d.ep_name == "CUDAExecutionProvider"]
    if not cuda:
        lib = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
        try:
            ort.register_execution_provider_library("CUDAExecutionProvider", str(lib))
        except RuntimeError as e:  # ONNX Runtime's errors (Fail, InvalidArgument, ...) are RuntimeErrors
            log.debug("could not register %s for its pinned allocator: %s", lib, e)
            return None
        cuda = [d for d in ort.get_ep_devices() if d.ep_name == "CUDAExecutionProvider"]
    if not cuda:
        return None
    dev = cuda[device_id] if device_id < len(cuda) else cuda[0]
    info = dev.memory_info(ort.OrtDeviceMemoryType.HOST_ACCESSIBLE)
    # the values it allocates report device "cuda" (device_name() has no memory type): the info says they are host memory
    host = info is not None and info.device_mem_type == ort.OrtDeviceMemoryType.HOST_ACCESSIBLE
    return info if host else None


class PinnedInputs:
    """Host inputs of CUDA runs staged in page-locked OrtValues from ONNX Runtime's own CUDA pinned allocator.

    One buffer per input, kept while the input's shape and dtype stay the same: decode steps of a shared-buffer
    engine reuse theirs (ids, positions and lengths keep their shape); an input whose shape changes (the growing
    attention mask of a concat engine, prefill then decode) gets a new buffer and the old one goes back to ONNX
    Runtime's allocator. Each step writes the values through a numpy view of the buffer and binds the buffer as host
    memory: ONNX Runtime copies it to the GPU where a kernel reads it there (a DMA, the pages being locked) and hands
    it as is to kernels that read an input on the CPU (GroupQueryAttention's ``total_sequence_length``). Binding the
    OrtValue itself does not do: its device reads "cuda", and those kernels then read garbage.
    ``run_with_iobinding`` returns only after the copies, so the next step may overwrite the buffer. Where this
    onnxruntime has no pinned allocator, inputs are bound from pageable numpy memory (``pinned`` is then False):
    slower copies, same results.
    """

    def __init__(self, ort: Any, device_id: int) -> None:
        self._ort = ort
        try:
            self._memory_info = _pinned_memory_info(ort, device_id)
        except (RuntimeError, AttributeError, TypeError) as e:  # an onnxruntime whose EP-device API differs
            log.debug("no pinned allocator: %s", e)
            self._memory_info = None
        self.buffers: dict[str, tuple[tuple[tuple[int, ...], str], Any, np.ndarray]] = {}  # name -> (key, value, view)
        self.allocations = 0  # buffers made so far (a decode step of a shared-buffer engine makes none)

    @property
    def pinned(self) -> bool:
        """Whether inputs go through page-locked buffers (False: bound from pageable numpy arrays)."""
        return self._memory_info is not None

    def bind(self, io: Any, name: str, arr: np.ndarray) -> None:
        """Bind host array ``arr`` as input ``name`` of ``io``, through its pinned buffer when there is one."""
        arr = np.ascontiguousarray(arr)
        if self._memory_info is None:
            io.bind_cpu_input(name, arr)
            return
        key = (tuple(arr.shape), arr.dtype.str)
        if name not in self.buffers or self.buffers[name][0] != key:
            self.buffers[name] = (key, *self._allocate(arr.shape, arr.dtype))
            self.allocations += 1
        _, val, view = self.buffers[name]
        view[...] = arr
        io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), val.data_ptr())

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, np.ndarray]:
        """A pinned OrtValue of ``shape``/``dtype`` and a numpy view of its memory (host memory: writable in place)."""
        val = self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type, memory_info=self._memory_info)
        count = int(np.prod(shape, dtype=np.int64))
        raw = (ctypes.c_char * max(count * dtype.itemsize, 1)).from_address(val.data_ptr())
        return val, np.frombuffer(memoryview(raw), dtype=dtype, count=count).reshape(shape)


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
            _preload_cuda_libraries(ort)
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
        if self.device == "cuda" and self.sess.get_providers()[0] != "CUDAExecutionProvider":
            # ONNX Runtime falls back to the CPU when the CUDA provider cannot start (a CUDA/cuDNN library missing)
            raise BackendUnavailableError(
                f"ONNX Runtime could not start its CUDA provider for {model} (session providers: "
                f"{self.sess.get_providers()}); install the CUDA libraries it needs ('onnxruntime-gpu[cuda,cudnn]' "
                "or a CUDA toolkit of the version it was built for) or use provider 'cpu'")
        got = [i.name for i in self.sess.get_inputs()]
        if got != self.input_names:
            raise EngineLoadError(f"{model} inputs {got[:4]}... differ from the manifest's; rebuild the engine")
        # a graph opened without an engine directory (scoring a stage) has no row-selection graph: batch 1 needs none
        select = manifest.files.get("kv_select")
        self.select_sess = (None if select is None else
                            ort.InferenceSession(str(engine_dir / select), so, providers=providers))
        geo = manifest.geometry
        self._kv_shape = (geo["num_kv_heads"], geo["head_dim"])
        self._kv_dtype = kv_dtype(manifest.raw["io"])  # float16/bfloat16 in fp16/bf16 engines
        self._needs_positions = "position_ids" in self.input_names
        self.staging = PinnedInputs(ort, config.device_id) if self.device == "cuda" else None

    def close(self) -> None:
        """Give the pinned input buffers back to ONNX Runtime's allocator (the sessions go with the object)."""
        if self.staging is not None:
            self.staging.buffers.clear()

    # --- host buffers -------------------------------------------------------------------------------------
    def _bind_host_input(self, io: Any, name: str, arr: np.ndarray) -> None:
        if self.staging is None:
            io.bind_cpu_input(name, arr)
        else:
            self.staging.bind(io, name, arr)

    # --- interface ------------------------------------------------------------------------------------------
    def _kv_value(self, shape: tuple[int, ...]) -> Any:
        """A zeroed KV tensor of the engine's KV type (zeros: unused buffer slots are read as 0 * x, never NaN)."""
        ov = self._ort.OrtValue
        if self._kv_dtype != "bfloat16":
            return ov.ortvalue_from_numpy(np.zeros(shape, self._kv_dtype), self.device, self.config.device_id)
        # bf16 zero is the all-zero bit pattern; numpy has no bfloat16, so the host zeros are uint16 seen as bf16
        host = ov.ortvalue_from_numpy_with_onnx_type(np.zeros(shape, np.uint16), 16)
        if self.device == "cpu":
            return host
        val = ov.ortvalue_from_shape_and_type(list(shape), 16, self.device, self.config.device_id)
        if all(shape):  # device memory starts uninitialized; an empty (concat) past has nothing to copy
            val.update_inplace(host)  # an OrtValue source: copied as bf16, no numpy dtype check
        return val

    def _run(self, feeds: dict[str, np.ndarray], kv_in: list[Any], kv_out: list[Any] | None,
             positions: np.ndarray) -> tuple[np.ndarray, list[Any]]:
        """One forward pass; logits ``[B,K,V]`` at ``positions [B,K]`` of each row.

        ``kv_out`` None: presents are new values (concat); else bound in place (shared).
        """
        if self.has_logits_positions:
            feeds = {**feeds, LOGITS_POSITIONS: np.ascontiguousarray(positions, dtype=np.int64)}
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
        return self._select(outs[0].numpy(), positions), (list(outs[1:]) if kv_out is None else kv_out)

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
            logits, vals = self._run(feeds, bufs, bufs, (lengths - 1)[:, None])  # each row's last real token
            return logits[:, -1, :], KVCache(vals, lengths, capacity=cap)
        mask = np.zeros((n, width), dtype=np.int64)
        for r, p in enumerate(prompts):  # left padding: every row's last token is at the same column
            ids[r, width - len(p):] = p
            mask[r, width - len(p):] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        empty = [self._kv_value((n, kvh, 0, hd)) for _ in self.past_names]
        last = np.full((n, 1), width - 1, dtype=np.int64)
        logits, vals = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, empty, None, last)
        return logits[:, -1, :], KVCache(vals, lengths, mask=mask)

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
            logits, vals = self._run(feeds, kv.values, kv.values, np.zeros_like(tokens))
            return logits[:, -1, :], KVCache(vals, kv.lengths + 1, capacity=kv.capacity)
        assert kv.mask is not None
        mask = np.concatenate([kv.mask, np.ones((kv.batch, 1), np.int64)], axis=1)
        logits, vals = self._run({"input_ids": tokens, "attention_mask": mask, "position_ids": pos}, kv.values, None,
                                 np.zeros_like(tokens))
        return logits[:, -1, :], KVCache(vals, kv.lengths + 1, mask=mask)

    def run_chunk(self, tokens: Sequence[int], kv: KVCache | None, capacity: int,
                  positions: Sequence[int] | None = None) -> tuple[np.ndarray, KVCache]:
        self.check_can_score()
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        if kv is not None and kv.batch != 1:
            raise InputError(f"run_chunk continues one sequence; the cache holds {kv.batch} rows")
        start = 0 if kv is None else int(kv.lengths[0])
        want = (np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, np.int64))[None, :]
        if n == 0 or want.size == 0 or want.min() < 0 or want.max() >= n:
            raise InputError(f"run_chunk needs at least one token and positions inside the chunk of {n}, "
                             f"got {want[0].tolist()[:8]}")
        pos = np.arange(start, start + n, dtype=np.int64)[None, :]
        lengths = np.array([start + n], dtype=np.int64)
        kvh, hd = self._kv_shape
        if self.kv_layout == "shared_buffer":
            cap = capacity if kv is None else kv.capacity
            if start + n > cap:
                raise InputError(f"KV buffers hold {cap} positions; the sequence would need {start + n}")
            bufs = [self._kv_value((1, kvh, cap, hd)) for _ in self.past_names] if kv is None else kv.values
            feeds: dict[str, np.ndarray] = {"input_ids": ids, "seqlens_k": (lengths - 1).astype(np.int32),
                                            "total_sequence_length": np.array(start + n, dtype=np.int32)}
            if self._needs_positions:
                feeds["position_ids"] = pos
            logits, vals = self._run(feeds, bufs, bufs, want)
            return logits[0], KVCache(vals, lengths, capacity=cap)
        past = [self._kv_value((1, kvh, 0, hd)) for _ in self.past_names] if kv is None else kv.values
        mask = np.ones((1, start + n), dtype=np.int64)
        logits, vals = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, past, None, want)
        return logits[0], KVCache(vals, lengths, mask=mask)

    def select_rows(self, kv: KVCache, rows: Sequence[int]) -> KVCache:
        if self.select_sess is None:
            raise EngineLoadError(f"{self.engine_dir} has no kv_select graph: it runs one sequence at a time")
        io = self.select_sess.io_binding()
        self._bind_host_input(io, "rows", np.asarray(rows, dtype=np.int64))
        for i, val in enumerate(kv.values):
            io.bind_ortvalue_input(f"kv.{i}", val)
            io.bind_output(f"out.{i}", self.device, self.config.device_id)
        self.select_sess.run_with_iobinding(io)
        idx = list(rows)
        return KVCache(list(io.get_outputs()), kv.lengths[idx], None if kv.mask is None else kv.mask[idx],
                       kv.capacity)
