"""The TensorRT session: a serialized engine driven through execution contexts, device buffers and one CUDA stream.

Behind the same :class:`~trtinfer.runtime.session.DecoderSession` interface as ONNX Runtime, so the slot cache (and
everything on it) does not change. Each TensorRT call names the documented Python API method (TensorRT 10 Python API reference)::

    load      Runtime(logger).deserialize_cuda_engine(plan); engine.num_optimization_profiles;
              create_execution_context() per profile + set_optimization_profile_async(i, stream)
    a step    set_input_shape(name, shape) and set_tensor_address(name, ptr) for every I/O tensor;
              execute_async_v3(stream) after host-to-device copies from pinned buffers; the logits' device-to-host
              copy into a pinned buffer; one stream synchronize
    KV        ``scatter_buffer`` layout: per slot cache one zeroed device buffer [S,KV,max_seq,D] per past tensor,
              bound as both ``past_key_values.*`` and its ``present.*`` (TensorRT's KV-cache update layer writes in
              place and requires that aliasing: ``ICudaEngine.get_aliased_input_tensor``); never copied to the host
    graphs    optional CUDA graph of a decode step (RuntimeConfig.cuda_graphs): captured after one ordinary step of
              the same shapes, replayed with one launch while batch and buffers stay the same

Each slot cache's host/device I/O buffers live in its own :class:`_Staging`, so caches never share them. One stream
per session: passes of concurrent caches on one session are serialized by a lock.

Not executed in this repository (TensorRT cannot be installed on our machines; README "what is verified where"):
type-checked against tensorrt-stubs, feed planning shared with tests on CPU.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trtinfer.artifact import Manifest
from trtinfer.errors import BackendUnavailableError, EngineLoadError, InputError
from trtinfer.runtime import cuda
from trtinfer.runtime.config import RuntimeConfig
from trtinfer.runtime.session import LOGITS_POSITIONS, DecoderSession, register_backend
from trtinfer.runtime.trt_plan import ProfilePlan, check_compatible, select_profile

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

GREEDY = "greedy_ids"
MIN_TENSORRT = (10, 15)  # ONNX TensorScatter -> the in-place KV-cache update layer


def import_tensorrt(who: str = "this TensorRT engine") -> Any:
    """``tensorrt`` (>= 10.15), or BackendUnavailableError saying what is missing and what to install.

    A ``tensorrt`` folder holding only type stubs (the ``tensorrt-stubs`` package) imports as an empty namespace
    package: that counts as missing.
    """
    need = (f"{who} needs TensorRT >= {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} (the 'tensorrt' Python package) and an "
            "NVIDIA GPU")
    try:
        import tensorrt
    except ImportError as e:
        raise BackendUnavailableError(f"{need}, but tensorrt is not installed here; install 'trtinfer[tensorrt]' on a "
                                      "GPU machine, or use --backend onnxruntime") from e
    version = getattr(tensorrt, "__version__", None)
    if version is None or not hasattr(tensorrt, "Builder"):
        raise BackendUnavailableError(f"{need}, but the importable 'tensorrt' has no library (type stubs only?); "
                                      "install 'trtinfer[tensorrt]' on a GPU machine, or use --backend onnxruntime")
    if tuple(int(x) for x in str(version).split(".")[:2]) < MIN_TENSORRT:
        raise BackendUnavailableError(f"{need}; this is TensorRT {version}: upgrade it")
    return tensorrt


class _Staging:
    """One slot cache's I/O buffers: a pinned host buffer and a device buffer per input, device buffers per output,
    pinned buffers for what comes back; grown on demand, reused by every pass of the cache (fixed addresses,
    which CUDA graph replay needs)."""

    def __init__(self, stream: cuda.Stream) -> None:
        self.stream = stream
        self.host: dict[str, cuda.PinnedBuffer] = {}
        self.device: dict[str, cuda.DeviceBuffer] = {}
        self.graph: cuda.CudaGraph | None = None
        self.graph_key: tuple[Any, ...] | None = None

    def put(self, name: str, arr: np.ndarray) -> None:
        """Stage ``arr`` in its pinned buffer and queue the copy to the device."""
        ptr = self.out(name, arr.nbytes, host=True)
        self.host[name].view(arr.shape, arr.dtype)[...] = arr
        cuda.copy_to_device(ptr, self.host[name], arr.nbytes, self.stream)

    def out(self, name: str, nbytes: int, host: bool) -> int:
        """A device buffer of at least ``nbytes`` for ``name`` (and a pinned twin for an input staged through it or an
        output that comes back)."""
        if name not in self.device or self.device[name].nbytes < nbytes:
            self.drop_graph()  # a moved buffer invalidates the captured addresses
            self.device[name] = cuda.DeviceBuffer(nbytes)
            self.host.pop(name, None)  # a pinned twin must be as large: made anew below
        if host and name not in self.host:
            self.host[name] = cuda.PinnedBuffer(self.device[name].nbytes)
        return self.device[name].ptr

    def fetch(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        """Queue the device-to-host copy of output ``name`` (``shape``, ``dtype``) into its pinned buffer."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        cuda.copy_to_host(self.host[name], self.device[name].ptr, nbytes, self.stream)

    def drop_graph(self) -> None:
        """Forget the captured decode graph."""
        if self.graph is not None:
            self.graph.close()
        self.graph, self.graph_key = None, None

    def release(self) -> None:
        """Free every buffer of this cache (the slot cache gives its staging back by this name, as ONNX Runtime's)."""
        self.drop_graph()
        for buf in [*self.host.values(), *self.device.values()]:
            buf.free()
        self.host.clear()
        self.device.clear()


@register_backend("tensorrt")
class TrtDecoderSession(DecoderSession):
    """TensorRT engine: two profiles (prefill, decode), one execution context each, KV on the device."""

    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
        super().__init__(engine_dir, manifest, config)
        import_tensorrt()
        if self.kv_layout != "scatter_buffer":
            raise EngineLoadError(f"{engine_dir}: TensorRT engines use the scatter_buffer KV layout, this one has "
                                  f"{self.kv_layout}; rebuild it with --backend tensorrt")
        import tensorrt as trt  # checked by import_tensorrt; imported by name so mypy checks the calls below

        info = manifest.tensorrt
        cuda.set_device(config.device_id)
        check_compatible(info, {"tensorrt_version": trt.__version__, **cuda.device_info(config.device_id)},
                         str(engine_dir))
        self.stream = cuda.Stream()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        path = engine_dir / manifest.files["decoder"]
        engine: trt.ICudaEngine | None = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:  # TensorRT logged why (version, corrupt file)
            raise EngineLoadError(f"TensorRT could not deserialize {path}; rebuild it with `trtinfer build ... "
                                  "--backend tensorrt` on this machine")
        self.engine = engine
        self.plan = ProfilePlan.from_list(info["profiles"])
        if self.engine.num_optimization_profiles != len(self.plan.profiles):
            raise EngineLoadError(f"{path} has {self.engine.num_optimization_profiles} profiles, its tensorrt.json "
                                  f"{len(self.plan.profiles)}; rebuild the engine")
        self.contexts: list[trt.IExecutionContext] = []
        for i in range(self.engine.num_optimization_profiles):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(i, self.stream.handle)  # before any set_input_shape
            self.contexts.append(ctx)
        self.stream.synchronize()
        self._check_aliases()
        self.capacity = self.scatter_capacity  # the graph's fixed KV slot count
        self._kv_bytes_per_row = self.kv_row_bytes(self.capacity)
        logits = manifest.io.output("logits")
        assert logits is not None
        self._logits_dtype = np.dtype(logits.dtype)  # the graph's dtype names are numpy's
        self._vocab = int(manifest.geometry["vocab_size"])
        self._lock = threading.Lock()
        self.device = "cuda"

    def _check_aliases(self) -> None:
        """Each ``present.*`` must alias its ``past_key_values.*`` (ICudaEngine.get_aliased_input_tensor, TRT >= 10.15)."""
        get = getattr(self.engine, "get_aliased_input_tensor", None)
        if get is None:
            raise EngineLoadError(f"{self.engine_dir}: this TensorRT lacks get_aliased_input_tensor (10.15+), which "
                                  "the in-place KV cache needs; install TensorRT >= 10.15 and rebuild")
        for past, present in zip(self.past_names, self.present_names):
            if get(present) != past:
                raise EngineLoadError(f"{self.engine_dir}: output {present} does not alias {past} in this engine; "
                                      "rebuild it with the current trtinfer")

    def close(self) -> None:
        """Release the contexts and the stream (slot caches free their own buffers; the engine goes with the object)."""
        self.contexts.clear()
        self.stream.close()

    # --- one pass --------------------------------------------------------------------------------------------
    def _run(self, feeds: dict[str, np.ndarray], rows: list[int], st: _Staging) -> np.ndarray:
        """One forward pass on the KV rows starting at device addresses ``rows`` (one per past tensor); logits
        ``[B,K,V]`` as float32. Call under the session's lock."""
        cuda.set_device(self.config.device_id)  # the CUDA runtime's current device is per thread
        b, k = feeds[LOGITS_POSITIONS].shape
        shapes = {n: tuple(a.shape) for n, a in feeds.items()}
        ctx = self.contexts[select_profile(self.plan, shapes)]
        key = (id(ctx), b, k, tuple(rows))
        graphable = self.config.cuda_graphs and k == 1 and shapes["input_ids"][1] == 1  # decode steps only
        if graphable and st.graph_key == key and st.graph is not None:  # replay
            for name, arr in feeds.items():  # the graph re-copies from these pinned buffers
                st.host[name].view(arr.shape, arr.dtype)[...] = arr
            st.graph.launch()
        else:
            capture = graphable and st.graph_key == key  # the second step of these shapes: the first warmed up
            self._bind(ctx, feeds, rows, st, b, k)
            if capture:
                st.drop_graph()  # a graph of other shapes captured before: freed, not leaked
                st.graph = cuda.CudaGraph(self.stream)
                st.graph.begin()
            self._enqueue(ctx, feeds, st, b, k)
            if capture:
                assert st.graph is not None
                st.graph.end()
                st.graph.launch()
            st.graph_key = key
        logits = st.host["logits"].view((b, k, self._vocab), self._logits_dtype)
        self.stream.synchronize()
        return logits.astype(np.float32)

    def _bind(self, ctx: trt.IExecutionContext, feeds: dict[str, np.ndarray], rows: list[int], st: _Staging, b: int,
              k: int) -> None:
        """set_input_shape / set_tensor_address for every I/O tensor of this step."""
        for name, arr in feeds.items():
            ctx.set_input_shape(name, arr.shape)
            ctx.set_tensor_address(name, st.out(name, arr.nbytes, host=True))
        for past, present, ptr in zip(self.past_names, self.present_names, rows):
            ctx.set_input_shape(past, (b, self.kv_shape[0], self.capacity, self.kv_shape[1]))
            ctx.set_tensor_address(past, ptr)
            ctx.set_tensor_address(present, ptr)  # aliased: the update layer writes in place
        logits_bytes = b * k * self._vocab * self._logits_dtype.itemsize
        ctx.set_tensor_address("logits", st.out("logits", logits_bytes, host=True))
        ctx.set_tensor_address(GREEDY, st.out(GREEDY, b * k * 4, host=False))  # the graph's output, unread here

    def _enqueue(self, ctx: trt.IExecutionContext, feeds: dict[str, np.ndarray], st: _Staging, b: int, k: int) -> None:
        """Copies in, execute_async_v3, the logits copied out: all queued on the session's stream."""
        for name, arr in feeds.items():
            st.put(name, arr)
        if not ctx.execute_async_v3(self.stream.handle):
            raise cuda.CudaError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
        st.fetch("logits", (b, k, self._vocab), self._logits_dtype)

    # --- slot rows (the scheduler's KV cache): statically checked only, TensorRT cannot run here --------------
    def new_staging(self) -> _Staging:
        """A slot cache's own host and device I/O buffers (and its captured decode graph)."""
        return _Staging(self.stream)

    def slot_values(self, slots: int, capacity: int) -> list[Any]:
        if capacity != self.capacity:
            raise InputError(f"this TensorRT engine's KV buffers hold {self.capacity} positions, not {capacity}")
        with self._lock:
            cuda.set_device(self.config.device_id)
            bufs = [cuda.DeviceBuffer(slots * self._kv_bytes_per_row) for _ in self.past_names]
            for buf in bufs:
                buf.zero(self.stream)
            self.stream.synchronize()
        return bufs

    @staticmethod
    def row_pointer(value: Any) -> int:
        return int(value.ptr)

    def copy_rows(self, values: list[Any], src: int, into: list[Any], dst: int, n: int, capacity: int) -> None:
        """:meth:`copy_rows_on_device` on the session's stream."""
        with self._lock:
            self.copy_rows_on_device(values, src, into, dst, n, capacity, self.stream)
            self.stream.synchronize()

    def run_rows(self, feeds: dict[str, np.ndarray], values: list[Any], first_row: int, rows: int, capacity: int,
                 positions: np.ndarray, staging: Any,
                 bindings: dict[Any, Any] | None = None) -> np.ndarray:
        """Rows ``first_row..`` of the slot buffers bound by address (a row's ``[KV, capacity, D]`` block is
        contiguous); a decode step of the same rows replays its CUDA graph."""
        ptrs = [int(v.ptr) + first_row * self._kv_bytes_per_row for v in values]
        with self._lock:
            return self._run(self.position_feeds(feeds, positions), ptrs, staging)
