"""ONNX Runtime's environment for trtinfer's sessions: execution providers, CUDA library preloading, page-locked
input staging, thread counts, and opening an ``InferenceSession`` that refuses a silent provider fallback.

Nothing here knows the KV cache or the graph's inputs: :mod:`trtinfer.runtime.ort_session` runs decoders on top of
it, :mod:`trtinfer.runtime.encoder` encoders, and the builder's engine checks both.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io as _io
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import Manifest
from trtinfer.errors import BackendUnavailableError, EngineLoadError, OutputError
from trtinfer.runtime.config import RuntimeConfig
from trtinfer.runtime.cuda import host_view
from trtinfer.runtime.memory import lean_weights
from trtinfer.runtime.page_out import ROW_PACKED_PRECISIONS, cpu_session

log = logging.getLogger(__name__)


def preload_cuda_libraries(ort: Any) -> None:
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
    if printed := out.getvalue().strip():
        log.debug("onnxruntime.preload_dlls: %s", printed)


def staging_memory_info(ort: Any, device_id: int) -> Any:
    """The OrtMemoryInfo of ONNX Runtime's page-locked host memory for CUDA device ``device_id``, or None (also where
    this onnxruntime's EP-device API differs): inputs then go pageable.

    ONNX Runtime (>= 1.23) hands out its CUDA provider's allocators through the provider's EP devices; the classic
    onnxruntime-gpu wheel lists none until its provider library is registered as a plugin, which is done once here.
    """
    try:
        if not all(hasattr(ort, n) for n in ("get_ep_devices", "OrtDeviceMemoryType",
                                              "register_execution_provider_library")):
            return None
        cuda = [d for d in ort.get_ep_devices() if d.ep_name == "CUDAExecutionProvider"]
        if not cuda:  # ONNX Runtime's errors (Fail, InvalidArgument, ...) are RuntimeErrors, logged below
            lib = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
            ort.register_execution_provider_library("CUDAExecutionProvider", str(lib))
            cuda = [d for d in ort.get_ep_devices() if d.ep_name == "CUDAExecutionProvider"]
        if not cuda:
            return None
        dev = cuda[device_id] if device_id < len(cuda) else cuda[0]
        info = dev.memory_info(ort.OrtDeviceMemoryType.HOST_ACCESSIBLE)
        # the values it allocates report device "cuda" (device_name() has no memory type): the info says host memory
        host = info is not None and info.device_mem_type == ort.OrtDeviceMemoryType.HOST_ACCESSIBLE
        return info if host else None
    except (RuntimeError, AttributeError, TypeError) as e:
        log.debug("no pinned allocator: %s", e)
        return None


class PinnedInputs:
    """One slot cache's host inputs of CUDA runs, staged in page-locked OrtValues from ONNX Runtime's CUDA pinned
    allocator (numpy and OrtValues only: no torch).

    Owned by one slot cache (:mod:`trtinfer.runtime.slots`), never by the session, so caches running on one session
    at once from different threads each write their own buffers, and the pinned memory held is a few small buffers
    per live cache: it goes back to ONNX Runtime's allocator when the cache closes (or at :meth:`release`). Not
    thread-safe itself: the passes of one cache run one after another.

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
        if name not in self.buffers or self.buffers[name][0] != key:  # a new buffer; the old one (if any) is freed
            val = self._ort.OrtValue.ortvalue_from_shape_and_type(list(arr.shape), arr.dtype.type,
                                                                   memory_info=self._memory_info)
            # a numpy view of its memory (host memory: writable in place)
            self.buffers[name] = (key, val, host_view(val.data_ptr(), arr.nbytes, arr.shape, arr.dtype))
            self.allocations += 1
        _, val, view = self.buffers[name]
        view[...] = arr
        io.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), val.data_ptr())

    def release(self) -> None:
        """Give every buffer back to ONNX Runtime's allocator now (a later :meth:`bind` makes new ones)."""
        self.buffers.clear()


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
    from trtinfer._cache import cache_path, key_of  # stdlib only: the runtime stays light

    stamps, versions = {}, {}
    for role, name in sorted(manifest.files.items()):
        with contextlib.suppress(OSError):  # the session reports a missing decoder; a key does not need every file
            st = (Path(engine_dir) / name).stat()
            stamps[role] = [name, st.st_size, st.st_mtime_ns]
    for dist in ("onnxruntime-gpu", "onnxruntime", *_TENSORRT_DISTS):  # those installed
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    root = cache_path() / "ort-trt"
    return root / key_of([manifest.to_dict(), stamps, versions]), root


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
        "trt_fp16_enable": manifest.precision == "fp16",
    }
    if config.trt_timing_cache:
        trt["trt_timing_cache_path"] = str(timing)
    if config.trt_max_workspace_size:
        trt["trt_max_workspace_size"] = config.trt_max_workspace_size
    return [(ORT_PROVIDERS["tensorrt"], trt), cuda, cpu]


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


#: x86 CPU flags under which MLAS's u8 x s8 GEMM (an int8 prefill graph's ``MatMulInteger``) accumulates exactly:
#: VNNI's ``vpdpbusd`` adds the four products in 32 bits; AVX2's ``vpmaddubsw`` adds pairs into int16 and saturates
#: (255 x 127 x 2 > 32767), which wrecks full-range int8 weights (ONNX Runtime's own int8 guidance: ``reduce_range``)
EXACT_U8S8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def u8s8_exact(machine: str, flags: set[str]) -> bool:
    """Whether MLAS's u8 x s8 GEMM is exact on a CPU of ``machine`` (``platform.machine()``) with ``flags`` (x86
    ``/proc/cpuinfo`` flags; ARM's kernels widen before they add)."""
    return machine.lower() not in ("x86_64", "amd64", "i686", "i386") or bool(flags & EXACT_U8S8_FLAGS)


@functools.cache
def this_cpu_u8s8_exact() -> bool:
    """:func:`u8s8_exact` for this machine (``/proc/cpuinfo``, read once a process; a machine without it counts as
    exact only off x86)."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    fields = (line.partition(":") for line in lines)
    flags = next((set(value.split()) for key, _, value in fields if key.strip() == "flags"), set())
    return u8s8_exact(platform.machine(), flags)


def row_packed(manifest: Manifest, graph: str = "decoder") -> bool:
    """Whether every GEMM weight of the engine's ``graph`` (its manifest's file role) is a ``MatMulNBits`` block
    (:data:`~trtinfer.runtime.page_out.ROW_PACKED_PRECISIONS`, no node kept in fp32): its mapped weights can be paged
    out while MLAS packs them. Never the int8 prefill graph: MLAS packs its ``MatMulInteger`` weights ``[K, N]`` in
    column panels as it does float ones (the 1B shape's int4 engine: its prefill graph loaded in 3.1 s, and in 400 s
    with its pages handed back every 10 ms)."""
    return graph != "prefill" and manifest.precision in ROW_PACKED_PRECISIONS and not manifest.kept_float


#: ONNX Runtime's session setting that lets the intra-op workers spin between a run's parallel sections ("0": sleep)
NO_SPINNING = "session.intra_op.allow_spinning"


def open_ort_session(model: Path, engine_dir: Path, manifest: Manifest, config: RuntimeConfig, *,
                     stop_spinning: bool = False, graph: str = "decoder") -> Any:
    """An ``onnxruntime.InferenceSession`` on ``model`` for ``config.provider``, or one line saying what is missing.

    GPU providers: the CUDA libraries of the nvidia-* wheels are preloaded, the provider must be offered, TensorRT's
    cache folders are made, and a session that fell back to another provider (ONNX Runtime does that silently when a
    CUDA, cuDNN or TensorRT library cannot load) is refused instead of running on the fallback. The graph was
    optimized offline at build time, so ONNX Runtime does not redo it on every load.

    ``stop_spinning``: the session's worker threads spin between the parallel sections of a run but sleep as soon as
    the run ends (ONNX Runtime's ``session.force_spinning_stop``). Two sessions of one engine (decoder and prefill
    graph) each have their own pool on the same cores; one's workers left spinning after its run take the cores the
    other's run needs (SmolLM2 int4 on 2 cores: decode 145 -> 105 tok/s while an idle prefill session spun; with the
    decoder spinning on and the prefill session not spinning at all, a 128-token prefill right after decode steps took
    103-126 ms, with both stopping at the end of a run 84-89 ms; decode 0-6% slower in benchmarks/prefill.py).
    (ONNX Runtime's one global pool for both is not an option: once it exists, every session of the process must
    use it.) ``graph``: which of the engine's graphs ``model`` is (its manifest's file role, :func:`row_packed`).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = config.intra_op_threads or default_intra_op_threads()
    so.log_severity_level = 3
    if stop_spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if not config.spinning:
        so.add_session_config_entry(NO_SPINNING, "0")
    if config.provider == "cpu":
        if config.prepack_weights is not True:  # no second copy of a model that big
            lean_weights(so, model, always=config.prepack_weights is False)
    else:
        preload_cuda_libraries(ort)
        name, offered = ORT_PROVIDERS[config.provider], ort.get_available_providers()
        if name not in offered:  # one line: what is missing, what to do
            others = "'cuda' or 'cpu'" if config.provider == "tensorrt" else "'cpu'"
            raise BackendUnavailableError(
                f"provider '{config.provider}' needs onnxruntime-gpu with {name}; this onnxruntime offers {offered}; "
                f"{_INSTALL_HINT[config.provider]} or use provider {others}")
    if config.provider == "tensorrt":  # ONNX Runtime creates only the last level of a cache path itself
        for folder in trt_cache_paths(engine_dir, manifest, config):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                err = OutputError(f"cannot create the TensorRT cache folder {folder} ({e.strerror or e}); set "
                                  "RuntimeConfig.trt_cache_dir (or TRTINFER_CACHE) to a writable folder")
                err.path = str(folder)
                raise err from e
    providers = ort_providers(config, manifest, engine_dir)
    if config.provider != "cpu" and manifest.precision == "fp32":
        # ONNX Runtime's CUDA provider runs fp32 MatMuls in TF32 (10-bit mantissa) on Ampere and newer unless told
        # not to: an fp32 engine would then miss its fp32 engine check (SmolLM2-135M on an H100: 0.045 on logits of 29)
        providers = [(p[0], {**p[1], "use_tf32": 0}) if isinstance(p, tuple) and p[0] == ORT_PROVIDERS["cuda"] else p
                     for p in providers]
    try:
        # MLAS packs the weights it reads: the mapped originals need not stay resident beside the packed copy
        sess = cpu_session(str(model), so, model.parent, providers, row_packed=row_packed(manifest, graph),
                           huge_pages=config.huge_pages)
    except Exception as e:
        said = " ".join(str(e).split())  # ONNX Runtime's message, on one line
        raise EngineLoadError(f"ONNX Runtime could not load {model}: {said}; rebuild the engine") from e
    if config.provider == "cpu":
        return sess
    started = sess.get_providers()
    if started[0] != name:
        fix = ("install the CUDA libraries it needs ('onnxruntime-gpu[cuda,cudnn]' or a CUDA toolkit of the "
               "version it was built for) or use provider 'cpu'" if config.provider == "cuda" else
               "install TensorRT 10 ('trtinfer[tensorrt]') and put its libraries on the loader path (e.g. "
               "LD_LIBRARY_PATH=<site-packages>/tensorrt_libs), or use provider 'cuda'")
        raise BackendUnavailableError(f"ONNX Runtime could not start its {name} for {model} (session providers: "
                                      f"{started}); {fix}")
    return sess
