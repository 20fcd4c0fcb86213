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
import importlib
import importlib.metadata
import io as _io
import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.errors import BackendUnavailableError, EngineLoadError, InputError, OutputError
from trtinfer.runtime.config import GPU_PROVIDERS, RuntimeConfig

# LOGITS_POSITIONS: graph input [B,K] int64, the positions whose logits the graph computes
from trtinfer.runtime.kv_feeds import LOGITS_POSITIONS, chunk_feeds, decode_feeds, prefill_feeds
from trtinfer.runtime.manifest import Manifest, kv_dtype
from trtinfer.runtime.memory import lean_weights

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

    def copy_cache(self, kv: KVCache) -> KVCache:
        """An independent copy of a one-row cache (a forked context), made on the backend's device."""
        raise EngineLoadError(f"the {type(self).__name__} backend cannot copy a KV cache")

    def truncate_cache(self, kv: KVCache, n: int) -> KVCache:
        """The cache of a one-row sequence rolled back to its first ``n`` tokens."""
        raise EngineLoadError(f"the {type(self).__name__} backend cannot truncate a KV cache")

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
_LAZY_BACKENDS = {"tensorrt": "trtinfer.runtime.trt_session"}  # imported when an engine needs them


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


def _staging_memory_info(ort: Any, device_id: int) -> Any:
    """:func:`_pinned_memory_info`, or None where this onnxruntime's EP-device API differs (inputs then go pageable)."""
    try:
        return _pinned_memory_info(ort, device_id)
    except (RuntimeError, AttributeError, TypeError) as e:
        log.debug("no pinned allocator: %s", e)
        return None


class PinnedInputs:
    """One generation's host inputs of CUDA runs, staged in page-locked OrtValues from ONNX Runtime's CUDA pinned
    allocator (numpy and OrtValues only: no torch).

    Owned by one generation, never by the session: :meth:`OrtDecoderSession.prefill` (or a first ``run_chunk``) makes
    one and puts it in the :attr:`KVCache.staging` of the caches it and its successors return, so generations running
    on one session at once from different threads each write their own buffers, and the pinned memory held is a few
    small buffers per live generation: it goes back to ONNX Runtime's allocator when the generation's last cache is
    dropped (or at :meth:`release`). Not thread-safe itself: the steps of one generation run one after another.

    One buffer per input, kept while the input's shape and dtype stay the same: decode steps of a shared-buffer
    engine reuse theirs (ids, positions and lengths keep their shape); an input whose shape changes (the growing
    attention mask of a concat engine, prefill then decode) gets a new buffer and the old one goes back to ONNX
    Runtime's allocator. Each step writes the values through a numpy view of the buffer and binds the buffer as host
    memory: ONNX Runtime copies it to the GPU where a kernel reads it there (a DMA, the pages being locked) and hands
    it as is to kernels that read an input on the CPU (GroupQueryAttention's ``total_sequence_length``). Binding the
    OrtValue itself does not do: its device reads "cuda", and those kernels then read garbage.
    ``run_with_iobinding`` returns only after the copies, so the next step may overwrite the buffer. Where this
    onnxruntime has no pinned allocator (``memory_info`` None), inputs are bound from pageable numpy memory
    (``pinned`` is then False): slower copies, same results.
    """

    def __init__(self, ort: Any, memory_info: Any) -> None:
        self._ort = ort
        self._memory_info = memory_info
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
            self.buffers[name] = (key, *self._allocate(arr.shape, arr.dtype))  # the old buffer (if any) is freed
            self.allocations += 1
        _, val, view = self.buffers[name]
        view[...] = arr
        io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), val.data_ptr())

    def release(self) -> None:
        """Give every buffer back to ONNX Runtime's allocator now (a later :meth:`bind` makes new ones)."""
        self.buffers.clear()

    def _allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, np.ndarray]:
        """A pinned OrtValue of ``shape``/``dtype`` and a numpy view of its memory (host memory: writable in place)."""
        val = self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type, memory_info=self._memory_info)
        count = int(np.prod(shape, dtype=np.int64))
        raw = (ctypes.c_char * max(count * dtype.itemsize, 1)).from_address(val.data_ptr())
        return val, np.frombuffer(memoryview(raw), dtype=dtype, count=count).reshape(shape)


# --- execution providers ------------------------------------------------------------------------------------------
#: trtinfer's provider name -> ONNX Runtime's execution provider
ORT_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                 "tensorrt": "TensorrtExecutionProvider"}
#: pip distributions whose version is that of the TensorRT libraries (any of them may be installed)
_TENSORRT_DISTS = ("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt-cu12-libs", "tensorrt-cu13-libs")
_INSTALL_HINT = {
    "cuda": "install 'trtinfer[gpu]'",
    "tensorrt": "install 'trtinfer[gpu]' (onnxruntime-gpu ships the TensorRT provider) and TensorRT 10 "
                "('trtinfer[tensorrt]')",
}


def _dist_versions(names: Sequence[str]) -> dict[str, str]:
    """Installed version of each of the pip distributions ``names`` (those absent are left out)."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def engine_precision(manifest: Manifest) -> str:
    """The engine's precision (``fp32``, ``fp16``, ``bf16``, ``int4``, ...): the manifest's, or its KV type's."""
    if "precision" in manifest.raw:
        return str(manifest.raw["precision"])
    # a stage opened for scoring has no build record: its KV dtype says the float precision
    return {"float16": "fp16", "bfloat16": "bf16"}.get(kv_dtype(manifest.raw["io"]), "fp32")


def trt_cache_paths(engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> tuple[Path, Path]:
    """The folders of ONNX Runtime's TensorRT engine cache and timing cache for this engine: ``(engines, timing)``.

    ``config.trt_cache_dir`` holds both when given. Otherwise engines go to ``<cache>/ort-trt/<key>`` and the timing
    cache (kernel timings only, valid for any model on this GPU) to ``<cache>/ort-trt``, ``<cache>`` being
    ``$TRTINFER_CACHE`` (default ``~/.cache/trtinfer``). ``<key>`` hashes the manifest, the size and modification
    time of each engine file and the installed onnxruntime and TensorRT versions: ONNX Runtime names its cached
    engines after the graph's structure, not its weights, and reloads them unchecked, so an engine rebuilt in place
    or a new onnxruntime/TensorRT must land in a new folder rather than reuse a stale TensorRT engine (the
    documentation's warning, see :func:`ort_providers`). A TensorRT installed outside pip is not seen: after
    upgrading it, remove ``ort-trt``. Nothing is created here.
    """
    if config.trt_cache_dir is not None:
        folder = Path(config.trt_cache_dir).expanduser()
        return folder, folder
    from trtinfer._cache import _root_path, key_of  # stdlib only: the runtime stays light

    stamps = {}
    for role, name in sorted(manifest.files.items()):
        path = Path(engine_dir) / name
        try:
            st = path.stat()
        except OSError:
            continue  # the session reports a missing decoder; a key does not need every file
        stamps[role] = [name, st.st_size, st.st_mtime_ns]
    versions = _dist_versions(("onnxruntime-gpu", "onnxruntime", *_TENSORRT_DISTS))
    root = _root_path() / "ort-trt"
    return root / key_of([manifest.raw, stamps, versions]), root


def ort_providers(config: RuntimeConfig, manifest: Manifest, engine_dir: Path) -> list[Any]:
    """``RuntimeConfig`` + manifest -> the ``providers`` list of ``onnxruntime.InferenceSession``, first choice first.

    ``cpu``: CPU. ``cuda``: CUDA, then CPU. ``tensorrt``: TensorRT, then CUDA for the nodes TensorRT does not take,
    then CPU; TensorRT's engine cache is on (:func:`trt_cache_paths`), its timing cache as ``config`` says, fp16
    kernels allowed for fp16 engines, the workspace capped at ``config.trt_max_workspace_size`` when not 0. Plain data:
    nothing is loaded, nothing created (:class:`OrtDecoderSession` creates the cache folders).
    """
    # Option names and value types (bools as True/False in Python):
    # https://onnxruntime.ai/docs/execution-providers/TensorRT-ExecutionProvider.html#configurations
    cpu = ORT_PROVIDERS["cpu"]
    if config.provider == "cpu":
        return [cpu]
    cuda = (ORT_PROVIDERS["cuda"], {"device_id": config.device_id})
    if config.provider == "cuda":
        return [cuda, cpu]
    engines, timing = trt_cache_paths(engine_dir, manifest, config)
    trt: dict[str, Any] = {
        "device_id": config.device_id,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(engines),
        "trt_timing_cache_enable": config.trt_timing_cache,
        "trt_fp16_enable": engine_precision(manifest) == "fp16",
    }
    if config.trt_timing_cache:
        trt["trt_timing_cache_path"] = str(timing)
    if config.trt_max_workspace_size:
        trt["trt_max_workspace_size"] = config.trt_max_workspace_size
    return [(ORT_PROVIDERS["tensorrt"], trt), cuda, cpu]


def _check_provider_available(ort: Any, provider: str) -> None:
    """Raise :class:`BackendUnavailableError` (one line: what is missing, what to do) when this onnxruntime lacks the
    execution provider of ``provider``."""
    name = ORT_PROVIDERS[provider]
    offered = ort.get_available_providers()
    if name not in offered:
        others = "'cuda' or 'cpu'" if provider == "tensorrt" else "'cpu'"
        raise BackendUnavailableError(
            f"provider '{provider}' needs onnxruntime-gpu with {name}; this onnxruntime offers {offered}; "
            f"{_INSTALL_HINT[provider]} or use provider {others}")


def _make_dirs(folders: Sequence[Path]) -> None:
    """Create the TensorRT cache folders (ONNX Runtime creates only the last level of a path itself)."""
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            err = OutputError(f"cannot create the TensorRT cache folder {folder} ({e.strerror or e}); set "
                              "RuntimeConfig.trt_cache_dir (or TRTINFER_CACHE) to a writable folder")
            err.path = str(folder)
            raise err from e


def physical_cores(cpus: set[int] | frozenset[int]) -> int:
    """How many physical cores ``cpus`` (CPU numbers) span: hyper-threads of one core count once, as ONNX Runtime
    counts them; a CPU without topology information counts as its own core."""
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo / "physical_package_id").read_text().strip() + ":" + (topo / "core_id").read_text().strip())
        except OSError:
            cores.add(f"cpu{cpu}")  # no topology: count the CPU itself
    return len(cores)


def default_intra_op_threads() -> int:
    """The physical cores this process may run on when that is fewer than the machine's (``taskset``, a container's
    cpuset), else 0: ONNX Runtime's default of one thread per physical core of the machine, which would
    oversubscribe the allowed CPUs."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not on Linux
        return 0
    if len(allowed) >= (os.cpu_count() or len(allowed)):
        return 0
    return physical_cores(allowed)


def open_ort_session(model: Path, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> Any:
    """An ``onnxruntime.InferenceSession`` on ``model`` for ``config.provider``, or one line saying what is missing.

    GPU providers: the CUDA libraries of the nvidia-* wheels are preloaded, the provider must be offered, TensorRT's
    cache folders are made, and a session that fell back to another provider (ONNX Runtime does that silently when a
    CUDA, cuDNN or TensorRT library cannot load) is refused instead of running on the fallback. The graph was
    optimized offline at build time, so ONNX Runtime does not redo it on every load.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = config.intra_op_threads or default_intra_op_threads()
    so.log_severity_level = 3
    if config.provider == "cpu" and config.prepack_weights is not True:
        lean_weights(so, model, always=config.prepack_weights is False)  # no second copy of a model that big
    else:
        _preload_cuda_libraries(ort)
        _check_provider_available(ort, config.provider)
    if config.provider == "tensorrt":
        _make_dirs(trt_cache_paths(engine_dir, manifest, config))
    providers = ort_providers(config, manifest, engine_dir)
    if config.provider != "cpu" and engine_precision(manifest) == "fp32":
        # ONNX Runtime's CUDA provider runs fp32 MatMuls in TF32 (10-bit mantissa) on Ampere and newer unless told
        # not to: an fp32 engine would then miss its fp32 engine check (SmolLM2-135M on an H100: 0.045 on logits of 29)
        providers = [(p[0], {**p[1], "use_tf32": 0}) if isinstance(p, tuple) and p[0] == ORT_PROVIDERS["cuda"] else p
                     for p in providers]
    try:
        sess = ort.InferenceSession(str(model), so, providers=providers)
    except Exception as e:
        raise EngineLoadError(f"ONNX Runtime could not load {model}: {e}") from e
    if config.provider == "cpu":
        return sess
    name = ORT_PROVIDERS[config.provider]
    started = sess.get_providers()
    if started[0] != name:
        if config.provider == "cuda":
            fix = ("install the CUDA libraries it needs ('onnxruntime-gpu[cuda,cudnn]' or a CUDA toolkit of the "
                   "version it was built for) or use provider 'cpu'")
        else:
            fix = ("install TensorRT 10 ('trtinfer[tensorrt]') and put its libraries on the loader path (e.g. "
                   "LD_LIBRARY_PATH=<site-packages>/tensorrt_libs), or use provider 'cuda'")
        raise BackendUnavailableError(f"ONNX Runtime could not start its {name} for {model} (session providers: "
                                      f"{started}); {fix}")
    return sess


@register_backend("onnxruntime")
class OrtDecoderSession(DecoderSession):
    """ONNX Runtime with IOBinding: KV stays in OrtValues (on the device for CUDA and TensorRT) from step to step.

    Thread safety: one session may run several generations at once, one per thread. Each call makes its own
    IOBinding and ONNX Runtime's ``run_with_iobinding`` is thread-safe with separate IOBinding objects; everything a
    generation writes between steps lives in its :class:`KVCache` (device KV values, lengths, mask and, on CUDA, its
    own :class:`PinnedInputs`), never on the session. One generation's caches must be used from one thread at a time.
    :meth:`close` only after every generation has finished.
    """

    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
        super().__init__(engine_dir, manifest, config)
        import onnxruntime as ort

        self._ort = ort
        self.device = "cuda" if config.provider in GPU_PROVIDERS else "cpu"  # where the KV cache lives
        model = engine_dir / manifest.files["decoder"]
        self.sess = open_ort_session(model, engine_dir, manifest, config)
        so, providers = self.sess.get_session_options(), ort_providers(config, manifest, engine_dir)
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
        past = [t for t in manifest.raw["io"]["inputs"] if t["name"] in self.past_names[:1]]
        # scatter_buffer graphs fix their KV slot count (TensorRT needs it static): every buffer has exactly that many
        self._scatter_capacity = int(past[0]["shape"][2]) if past and isinstance(past[0]["shape"][2], int) else 0
        # host inputs of CUDA runs go through a per-generation PinnedInputs; the CPU binds numpy arrays directly
        self._stage_inputs = self.device == "cuda"
        self._staging_info = _staging_memory_info(ort, config.device_id) if self._stage_inputs else None
        self._stagings: weakref.WeakSet[PinnedInputs] = weakref.WeakSet()  # live generations' (for close, stats)
        self._stagings_lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        """Whether host inputs reach the GPU through page-locked buffers (False on the CPU, or without an allocator)."""
        return self._staging_info is not None

    def live_stagings(self) -> list[PinnedInputs]:
        """The host staging of each generation whose caches are still alive (empty on the CPU)."""
        with self._stagings_lock:
            return list(self._stagings)

    def close(self) -> None:
        """Give the pinned input buffers of live generations back to ONNX Runtime's allocator and drop the ONNX
        Runtime sessions (their weights and arenas are freed once nothing else holds them)."""
        for staging in self.live_stagings():
            staging.release()
        self.sess = None
        self.select_sess = None

    # --- host buffers -------------------------------------------------------------------------------------
    def _new_staging(self) -> PinnedInputs | None:
        """The host staging of a new generation: a fresh :class:`PinnedInputs` on CUDA, None on the CPU."""
        if not self._stage_inputs:
            return None
        staging = PinnedInputs(self._ort, self._staging_info)
        with self._stagings_lock:
            self._stagings.add(staging)
        return staging

    @staticmethod
    def _bind_host_input(io: Any, name: str, arr: np.ndarray, staging: PinnedInputs | None) -> None:
        if staging is None:
            io.bind_cpu_input(name, arr)
        else:
            staging.bind(io, name, arr)

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
             positions: np.ndarray, staging: PinnedInputs | None) -> tuple[np.ndarray, list[Any]]:
        """One forward pass; logits ``[B,K,V]`` at ``positions [B,K]`` of each row.

        ``kv_out`` None: presents are new values (concat); else bound in place (shared). Host inputs go through the
        generation's ``staging`` (None: bound from numpy). The IOBinding is this call's own (thread safety).
        """
        if self.has_logits_positions:
            feeds = {**feeds, LOGITS_POSITIONS: np.ascontiguousarray(positions, dtype=np.int64)}
        io = self.sess.io_binding()
        for name, arr in feeds.items():
            self._bind_host_input(io, name, arr, staging)
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
        staging = self._new_staging()  # this generation's own host buffers, handed on through its caches
        if self.kv_layout == "scatter_buffer":  # the tensorrt target's graph, run by ONNX Runtime
            feeds, lengths = prefill_feeds(prompts, self.pad_token_id, self._scatter_capacity)
            bufs = [self._kv_value((n, kvh, self._scatter_capacity, hd)) for _ in self.past_names]
            want = feeds.pop(LOGITS_POSITIONS)
            logits, vals = self._run(feeds, bufs, bufs, want, staging)  # present bound to past: written in place
            return logits[:, -1, :], KVCache(vals, lengths, capacity=self._scatter_capacity, staging=staging)
        if self.kv_layout == "shared_buffer":
            cap = max(capacity, width)
            # right padding, as the scatter layout: row r's tokens sit at 0..len-1, as in its buffer
            feeds, _ = prefill_feeds(prompts, self.pad_token_id, cap)
            want = feeds.pop(LOGITS_POSITIONS)  # each row's last real token
            if not self._needs_positions:
                del feeds["position_ids"]
            feeds["seqlens_k"] = (lengths - 1).astype(np.int32)
            feeds["total_sequence_length"] = np.array(width, dtype=np.int32)
            bufs = [self._kv_value((n, kvh, cap, hd)) for _ in self.past_names]
            logits, vals = self._run(feeds, bufs, bufs, want, staging)
            return logits[:, -1, :], KVCache(vals, lengths, capacity=cap, staging=staging)
        mask = np.zeros((n, width), dtype=np.int64)
        for r, p in enumerate(prompts):  # left padding: every row's last token is at the same column
            ids[r, width - len(p):] = p
            mask[r, width - len(p):] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        empty = [self._kv_value((n, kvh, 0, hd)) for _ in self.past_names]
        last = np.full((n, 1), width - 1, dtype=np.int64)
        logits, vals = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, empty, None, last,
                                 staging)
        return logits[:, -1, :], KVCache(vals, lengths, mask=mask, staging=staging)

    def decode(self, tokens: np.ndarray, kv: KVCache) -> tuple[np.ndarray, KVCache]:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        if tokens.shape[0] != kv.batch:
            raise InputError(f"decode got {tokens.shape[0]} tokens for a cache of {kv.batch} rows")
        pos = kv.lengths[:, None].astype(np.int64)
        staging = kv.staging
        if self.kv_layout == "scatter_buffer":
            feeds = decode_feeds(tokens, kv.lengths, kv.capacity)
            want = feeds.pop(LOGITS_POSITIONS)
            logits, vals = self._run(feeds, kv.values, kv.values, want, staging)
            return logits[:, -1, :], KVCache(vals, kv.lengths + 1, capacity=kv.capacity, staging=staging)
        if self.kv_layout == "shared_buffer":
            if int(kv.lengths.max()) + 1 > kv.capacity:
                raise InputError(f"KV buffers hold {kv.capacity} positions; a row would need "
                                 f"{int(kv.lengths.max()) + 1}: raise max_new_tokens' bound or the engine's max_seq_len")
            feeds = {"input_ids": tokens, "seqlens_k": kv.lengths.astype(np.int32),
                     "total_sequence_length": np.array(int(kv.lengths.max()) + 1, dtype=np.int32)}
            if self._needs_positions:
                feeds["position_ids"] = pos
            logits, vals = self._run(feeds, kv.values, kv.values, np.zeros_like(tokens), staging)
            return logits[:, -1, :], KVCache(vals, kv.lengths + 1, capacity=kv.capacity, staging=staging)
        assert kv.mask is not None
        mask = np.concatenate([kv.mask, np.ones((kv.batch, 1), np.int64)], axis=1)
        logits, vals = self._run({"input_ids": tokens, "attention_mask": mask, "position_ids": pos}, kv.values, None,
                                 np.zeros_like(tokens), staging)
        return logits[:, -1, :], KVCache(vals, kv.lengths + 1, mask=mask, staging=staging)

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
        staging = self._new_staging() if kv is None else kv.staging  # one sequence = one generation
        if self.kv_layout == "scatter_buffer":
            cap = self._scatter_capacity
            feeds = chunk_feeds(tokens, start, want[0], cap)
            bufs = [self._kv_value((1, kvh, cap, hd)) for _ in self.past_names] if kv is None else kv.values
            logits, vals = self._run(feeds, bufs, bufs, feeds.pop(LOGITS_POSITIONS), staging)
            return logits[0], KVCache(vals, lengths, capacity=cap, staging=staging)
        if self.kv_layout == "shared_buffer":
            cap = capacity if kv is None else kv.capacity
            if start + n > cap:
                raise InputError(f"KV buffers hold {cap} positions; the sequence would need {start + n}")
            bufs = [self._kv_value((1, kvh, cap, hd)) for _ in self.past_names] if kv is None else kv.values
            feeds = {"input_ids": ids, "seqlens_k": (lengths - 1).astype(np.int32),
                     "total_sequence_length": np.array(start + n, dtype=np.int32)}
            if self._needs_positions:
                feeds["position_ids"] = pos
            logits, vals = self._run(feeds, bufs, bufs, want, staging)
            return logits[0], KVCache(vals, lengths, capacity=cap, staging=staging)
        past = [self._kv_value((1, kvh, 0, hd)) for _ in self.past_names] if kv is None else kv.values
        # a row taken out of a batch keeps its left padding: its mask says which past columns are real
        before = np.ones((1, start), np.int64) if kv is None or kv.mask is None else kv.mask
        mask = np.concatenate([before, np.ones((1, n), np.int64)], axis=1)
        logits, vals = self._run({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, past, None, want,
                                 staging)
        return logits[0], KVCache(vals, lengths, mask=mask, staging=staging)

    def copy_cache(self, kv: KVCache) -> KVCache:
        """A copy through the row-selection graph (a Gather on the device), or, for a stage's graph on the CPU
        (no such graph), a numpy copy; the copy gets its own host staging."""
        if self.select_sess is not None:
            copied = self.select_rows(kv, list(range(kv.batch)))
        elif self.device == "cpu":
            ov = self._ort.OrtValue
            copied = KVCache([ov.ortvalue_from_numpy(v.numpy().copy()) for v in kv.values], kv.lengths, kv.mask,
                             kv.capacity)
        else:
            raise EngineLoadError(f"{self.engine_dir} has no kv_select graph to copy a cache on the device; "
                                  "use an engine directory (trtinfer build)")
        return KVCache(copied.values, kv.lengths.copy(), None if kv.mask is None else kv.mask.copy(), kv.capacity,
                       staging=self._new_staging())

    def truncate_cache(self, kv: KVCache, n: int) -> KVCache:
        """Buffer layouts: only the length changes (slots past ``n`` are masked, then overwritten). Concat: the past
        tensors are cut to ``n`` positions (through host memory)."""
        if kv.batch != 1 or not 0 < n <= int(kv.lengths[0]):
            raise InputError(f"truncate_cache: a one-row cache of {int(kv.lengths[0])} tokens cannot keep {n}")
        lengths = np.array([n], dtype=np.int64)
        if self.kv_layout in ("shared_buffer", "scatter_buffer"):
            return KVCache(kv.values, lengths, capacity=kv.capacity, staging=kv.staging)
        assert kv.mask is not None
        ov = self._ort.OrtValue
        keep = kv.mask.shape[1] - int(kv.lengths[0]) + n  # left padding (a row taken out of a batch) + n tokens
        cut = [ov.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :keep]), self.device,
                                      self.config.device_id) for v in kv.values]
        return KVCache(cut, lengths, mask=kv.mask[:, :keep].copy(), staging=kv.staging)

    def select_rows(self, kv: KVCache, rows: Sequence[int]) -> KVCache:
        if self.select_sess is None:
            raise EngineLoadError(f"{self.engine_dir} has no kv_select graph: it runs one sequence at a time")
        io = self.select_sess.io_binding()
        self._bind_host_input(io, "rows", np.asarray(rows, dtype=np.int64), kv.staging)
        for i, val in enumerate(kv.values):
            io.bind_ortvalue_input(f"kv.{i}", val)
            io.bind_output(f"out.{i}", self.device, self.config.device_id)
        self.select_sess.run_with_iobinding(io)
        idx = list(rows)
        return KVCache(list(io.get_outputs()), kv.lengths[idx], None if kv.mask is None else kv.mask[idx],
                       kv.capacity, staging=kv.staging)
