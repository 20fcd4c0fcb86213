"""Device memory, pinned host memory, streams and CUDA graphs from ``cuda-python`` (``cuda.bindings.runtime``).

The TensorRT runtime needs raw device pointers and a stream handle; these come from NVIDIA's own Python bindings of
the CUDA runtime API, not torch, so the runtime stays torch-free. Every call below is a documented CUDA runtime
function (names as in the CUDA Runtime API reference; ``cuda.bindings.runtime`` returns ``(cudaError_t, *values)``
tuples, checked by :func:`_ok`).

Not executed on a GPU in this repository's CI (no GPU there): the module is type-checked and its host-side logic
(sizes, views) unit-tested; see README "what is verified where".
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np

from trtinfer.errors import BackendUnavailableError, TrtInferError

log = logging.getLogger(__name__)


class CudaError(TrtInferError):
    """A CUDA runtime call failed (out of memory, a launch failure, no device)."""


def cudart() -> Any:
    """The ``cuda.bindings.runtime`` module, or BackendUnavailableError saying how to get it."""
    try:
        from cuda.bindings import runtime
    except ImportError as e:
        raise BackendUnavailableError("the TensorRT backend needs cuda-python (cuda.bindings); install "
                                      "'trtinfer[tensorrt]'") from e
    return runtime


def _ok(result: Any, what: str) -> Any:
    """Unpack ``(err, *values)`` from a ``cuda.bindings.runtime`` call; raise CudaError naming ``what`` on failure."""
    rt = cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        _, text = rt.cudaGetErrorString(err)  # cudaGetErrorString
        raise CudaError(f"{what} failed: {text.decode() if isinstance(text, bytes) else text} ({err})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_info(device_id: int) -> dict[str, str]:
    """``{"gpu": name, "compute_capability": "9.0"}`` of CUDA device ``device_id`` (cudaGetDeviceProperties)."""
    rt = cudart()
    prop = _ok(rt.cudaGetDeviceProperties(device_id), "cudaGetDeviceProperties")
    name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
    return {"gpu": name.rstrip("\x00").strip(), "compute_capability": f"{prop.major}.{prop.minor}"}


def set_device(device_id: int) -> None:
    """Make ``device_id`` current for this thread (cudaSetDevice)."""
    _ok(cudart().cudaSetDevice(device_id), "cudaSetDevice")


class Stream:
    """A non-blocking CUDA stream (cudaStreamCreateWithFlags); ``handle`` is the integer TensorRT's
    ``execute_async_v3`` takes."""

    def __init__(self) -> None:
        rt = cudart()
        self.raw = _ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")

    @property
    def handle(self) -> int:
        """The stream as an integer (cudaStream_t)."""
        return int(self.raw)

    def synchronize(self) -> None:
        """Wait for everything queued on the stream (cudaStreamSynchronize)."""
        _ok(cudart().cudaStreamSynchronize(self.raw), "cudaStreamSynchronize")

    def close(self) -> None:
        """Destroy the stream (cudaStreamDestroy)."""
        if self.raw is not None:
            _ok(cudart().cudaStreamDestroy(self.raw), "cudaStreamDestroy")
            self.raw = None


class _Buffer:
    """``nbytes`` of memory from CUDA runtime function ``_ALLOC``, given back by ``_FREE`` at :meth:`free` or when
    collected."""

    _ALLOC, _FREE = "cudaMalloc", "cudaFree"

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(int(nbytes), 1)
        self.ptr: int = int(_ok(getattr(cudart(), self._ALLOC)(self.nbytes), f"{self._ALLOC}({self.nbytes} bytes)"))

    def free(self) -> None:
        """Give the memory back."""
        if self.ptr:
            _ok(getattr(cudart(), self._FREE)(self.ptr), self._FREE)
            self.ptr = 0

    def __del__(self) -> None:
        # at interpreter exit the CUDA context or the bindings may be gone already
        try:
            self.free()
        except (CudaError, BackendUnavailableError, AttributeError, TypeError) as e:
            log.debug("could not free a CUDA buffer of %d bytes: %s", self.nbytes, e)


class DeviceBuffer(_Buffer):
    """``nbytes`` of device memory (cudaMalloc), freed by :meth:`free` (cudaFree) or when collected."""

    def zero(self, stream: Stream) -> None:
        """Fill with zero bytes, queued on ``stream`` (cudaMemsetAsync)."""
        _ok(cudart().cudaMemsetAsync(self.ptr, 0, self.nbytes, stream.raw), "cudaMemsetAsync")


class PinnedBuffer(_Buffer):
    """``nbytes`` of page-locked host memory (cudaMallocHost, cudaFreeHost) with numpy views: DMA-able, so copies
    between it and the device run asynchronously on a stream."""

    _ALLOC, _FREE = "cudaMallocHost", "cudaFreeHost"

    def view(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A numpy array over the first bytes of the buffer (no copy); raises if it does not fit."""
        return host_view(self.ptr, self.nbytes, shape, dtype)


def host_view(ptr: int, nbytes: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A numpy array of ``shape``/``dtype`` over host memory at ``ptr`` holding ``nbytes`` (ValueError if too small)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dt.itemsize > nbytes:
        raise ValueError(f"a {shape} {dt} view needs {count * dt.itemsize} bytes, the buffer holds {nbytes}")
    raw = (ctypes.c_char * max(count * dt.itemsize, 1)).from_address(ptr)
    return np.frombuffer(memoryview(raw), dtype=dt, count=count).reshape(shape)


def copy_to_device(dst: int, src: PinnedBuffer, nbytes: int, stream: Stream) -> None:
    """Queue a host-to-device copy of ``nbytes`` from pinned ``src`` to device pointer ``dst`` (cudaMemcpyAsync)."""
    rt = cudart()
    _ok(rt.cudaMemcpyAsync(dst, src.ptr, nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream.raw),
        "cudaMemcpyAsync(host to device)")


def copy_to_host(dst: PinnedBuffer, src: int, nbytes: int, stream: Stream) -> None:
    """Queue a device-to-host copy of ``nbytes`` from device pointer ``src`` into pinned ``dst`` (cudaMemcpyAsync)."""
    rt = cudart()
    _ok(rt.cudaMemcpyAsync(dst.ptr, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost, stream.raw),
        "cudaMemcpyAsync(device to host)")


def copy_2d_on_device(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                      stream: Stream | None = None) -> None:
    """Copy ``height`` runs of ``width`` bytes, ``src_pitch`` / ``dst_pitch`` bytes apart, device to device
    (cudaMemcpy2DAsync). On ``stream``: queued there. Without one (a caller whose work runs on a stream it does not
    own, as ONNX Runtime's): on the default stream, then the device is synchronized, so the copy is complete before
    any later work on any stream."""
    rt = cudart()
    kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    _ok(rt.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, kind, 0 if stream is None else stream.raw),
        "cudaMemcpy2DAsync(device to device)")
    if stream is None:
        _ok(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


class CudaGraph:
    """Work captured from a stream once and replayed with one launch (cudaStreamBeginCapture / cudaStreamEndCapture /
    cudaGraphInstantiate / cudaGraphLaunch). The captured kernels read and write the same addresses on every replay:
    the caller rewrites the inputs in place and keeps every bound buffer alive while the graph lives."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.graph: Any = None
        self.exec: Any = None

    def begin(self) -> None:
        """Start recording the stream's work instead of running it."""
        rt = cudart()
        _ok(rt.cudaStreamBeginCapture(self.stream.raw, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
            "cudaStreamBeginCapture")

    def end(self) -> None:
        """Stop recording and instantiate the executable graph."""
        rt = cudart()
        self.graph = _ok(rt.cudaStreamEndCapture(self.stream.raw), "cudaStreamEndCapture")
        self.exec = _ok(rt.cudaGraphInstantiate(self.graph, 0), "cudaGraphInstantiate")

    def launch(self) -> None:
        """Replay the recorded work on the stream."""
        _ok(cudart().cudaGraphLaunch(self.exec, self.stream.raw), "cudaGraphLaunch")

    def close(self) -> None:
        """Free the graph (cudaGraphExecDestroy, cudaGraphDestroy)."""
        rt = cudart()
        if self.exec is not None:
            _ok(rt.cudaGraphExecDestroy(self.exec), "cudaGraphExecDestroy")
            self.exec = None
        if self.graph is not None:
            _ok(rt.cudaGraphDestroy(self.graph), "cudaGraphDestroy")
            self.graph = None
