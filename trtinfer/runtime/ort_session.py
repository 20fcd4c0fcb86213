"""The ONNX Runtime decoder session: binds a KV layout's feeds and the KV values with IOBinding and runs them.

What differs between KV layouts (padding, masks, buffers, truncation) is the layout's business
(:mod:`trtinfer.runtime.kv_layouts`); what an ONNX Runtime session needs from its environment (providers, CUDA
libraries, pinned staging) is :mod:`trtinfer.runtime.ort_env`'s. This class only allocates KV values, binds and runs.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import Manifest
from trtinfer.errors import EngineLoadError
from trtinfer.runtime.config import GPU_PROVIDERS, RuntimeConfig
from trtinfer.runtime.ort_env import PinnedInputs, open_ort_session, staging_memory_info, this_cpu_u8s8_exact
from trtinfer.runtime.session import DecoderSession, register_backend

log = logging.getLogger(__name__)

#: ONNX element types of the KV dtypes (IOBinding takes these for pointer bindings; numpy has no bfloat16)
_ONNX_TYPES = {"float32": 1, "float16": 10, "bfloat16": 16}
_LOGITS_DTYPES: dict[str, np.dtype[Any]] = {"tensor(float)": np.dtype(np.float32),
                                            "tensor(float16)": np.dtype(np.float16)}


@register_backend("onnxruntime")
class OrtDecoderSession(DecoderSession):
    """ONNX Runtime with IOBinding: KV stays in OrtValues (on the device for CUDA and TensorRT) from step to step.

    Thread safety: one session may run several slot caches at once, one per thread. ONNX Runtime's
    ``run_with_iobinding`` is thread-safe with separate IOBinding objects, and everything a cache writes between
    passes is its own (its KV buffers, its bindings and, on CUDA, its :class:`PinnedInputs`), never the session's.
    :meth:`close` only after every cache has closed.
    """

    def __init__(self, engine_dir: Path, manifest: Manifest, config: RuntimeConfig) -> None:
        super().__init__(engine_dir, manifest, config)
        import onnxruntime as ort

        self._ort = ort
        self.device = "cuda" if config.provider in GPU_PROVIDERS else "cpu"  # where the KV cache lives
        model = engine_dir / manifest.files["decoder"]
        # passes of several tokens (prefills, chunks, scoring) on the engine's int8 prefill graph, where it has one
        # (``trtinfer build --prefill int8``; :mod:`trtinfer.builder.prefill_graph`): same inputs, outputs and KV
        prefill = manifest.files.get("prefill") if config.provider == "cpu" and config.prefill_graph else None
        if prefill is not None and not this_cpu_u8s8_exact():
            log.warning("%s: the int8 prefill graph is not used on this CPU (no VNNI: its u8 x s8 GEMM saturates); "
                        "prompts run on the decoder graph", engine_dir)
            prefill = None
        self._on_decoder = threading.local()  # per thread: inside decoder_graph()
        two = prefill is not None  # two sessions on the same cores: neither's workers spin once its run is over
        self.sess = open_ort_session(model, engine_dir, manifest, config, stop_spinning=two)
        self.prefill_sess = None if prefill is None else open_ort_session(engine_dir / prefill, engine_dir, manifest,
                                                                           config, stop_spinning=True, graph="prefill")
        got = [i.name for i in self.sess.get_inputs()]
        if got != self.input_names:
            raise EngineLoadError(f"{model} inputs {got[:4]}... differ from the manifest's; rebuild the engine")
        # host inputs of CUDA runs go through a slot cache's own PinnedInputs; the CPU binds numpy arrays directly
        self._stage_inputs = self.device == "cuda"
        self._staging_info = staging_memory_info(ort, config.device_id) if self._stage_inputs else None
        self._stagings: weakref.WeakSet[PinnedInputs] = weakref.WeakSet()  # live caches' (for close, stats)
        self._stagings_lock = threading.Lock()
        # per graph: the numpy dtype and last dimension of its logits where that dimension is fixed (bound to a host
        # array each pass), else absent (ONNX Runtime allocates them)
        self._logits_out = {id(g): (_LOGITS_DTYPES[o.type], int(o.shape[-1]))
                            for g in (self.sess, self.prefill_sess) if g is not None for o in g.get_outputs()[:1]
                            if o.name == "logits" and o.type in _LOGITS_DTYPES and isinstance(o.shape[-1], int)}

    @property
    def pinned(self) -> bool:
        """Whether host inputs reach the GPU through page-locked buffers (False on the CPU, or without an allocator)."""
        return self._staging_info is not None

    def live_stagings(self) -> list[PinnedInputs]:
        """The host staging of each slot cache still alive (empty on the CPU)."""
        with self._stagings_lock:
            return list(self._stagings)

    def close(self) -> None:
        """Give the pinned input buffers of live caches back to ONNX Runtime's allocator and drop the ONNX
        Runtime sessions (their weights and arenas are freed once nothing else holds them)."""
        for staging in self.live_stagings():
            staging.release()
        self.sess = None
        self.prefill_sess = None

    # --- host buffers -------------------------------------------------------------------------------------
    def new_staging(self) -> PinnedInputs | None:
        """The host staging of a new slot cache: a fresh :class:`PinnedInputs` on CUDA, None on the CPU."""
        if not self._stage_inputs:
            return None
        staging = PinnedInputs(self._ort, self._staging_info)
        with self._stagings_lock:
            self._stagings.add(staging)
        return staging

    @staticmethod
    def bind_host_inputs(io: Any, feeds: dict[str, np.ndarray], staging: PinnedInputs | None) -> None:
        """Bind the host arrays ``feeds`` as inputs of ``io``: directly on the CPU, through ``staging`` on CUDA."""
        for name, arr in feeds.items():
            if staging is None:
                io.bind_cpu_input(name, arr)
            else:
                staging.bind(io, name, arr)

    # --- what the slot cache runs on ---------------------------------------------------------------------------
    def session_for(self, feeds: dict[str, np.ndarray]) -> Any:
        """The session that runs a pass: where the engine has a prefill graph, every pass of several tokens a row
        (prompts, whole or in chunks, and scoring) outside :meth:`decoder_graph`; else the decoder. Its activations are
        quantized token by token, so a prompt gives the same KV whatever chunks it comes in."""
        if (self.prefill_sess is not None and feeds["input_ids"].shape[1] > 1
                and not getattr(self._on_decoder, "active", False)):
            return self.prefill_sess
        if self.sess is None:  # closed (engine.close()) while a context, stream or other thread still used it
            raise EngineLoadError("the engine was closed; load it again with trtinfer.load()")
        return self.sess

    @contextlib.contextmanager
    def decoder_graph(self) -> Iterator[None]:
        was = getattr(self._on_decoder, "active", False)
        self._on_decoder.active = True
        try:
            yield
        finally:
            self._on_decoder.active = was

    def kv_value(self, shape: tuple[int, ...]) -> Any:
        """A zeroed KV tensor of the engine's KV type (zeros: unused buffer slots are read as 0 * x, never NaN)."""
        ov = self._ort.OrtValue
        if self.kv_dtype != "bfloat16":
            return ov.ortvalue_from_numpy(np.zeros(shape, self.kv_dtype), self.device, self.config.device_id)
        # bf16 zero is the all-zero bit pattern; numpy has no bfloat16, so the host zeros are uint16 seen as bf16
        host = ov.ortvalue_from_numpy_with_onnx_type(np.zeros(shape, np.uint16), 16)
        if self.device == "cpu":
            return host
        val = ov.ortvalue_from_shape_and_type(list(shape), 16, self.device, self.config.device_id)
        if all(shape):  # device memory starts uninitialized; an empty (concat) past has nothing to copy
            val.update_inplace(host)  # an OrtValue source: copied as bf16, no numpy dtype check
        return val

    def kv_value_from(self, host: np.ndarray) -> Any:
        """A KV tensor on this session's device holding a copy of ``host``."""
        return self._ort.OrtValue.ortvalue_from_numpy(host, self.device, self.config.device_id)

    def run_bound(self, feeds: dict[str, np.ndarray], kv_in: list[Any], positions: np.ndarray,
                  staging: PinnedInputs | None) -> tuple[np.ndarray, list[Any]]:
        """One pass of a layout that returns new KV (concat): logits ``[B,K,V]`` at ``positions [B,K]`` and the
        presents as new values. Host inputs go through ``staging`` (None: bound from numpy)."""
        feeds = self.position_feeds(feeds, positions)
        sess = self.session_for(feeds)
        io = sess.io_binding()
        self.bind_host_inputs(io, feeds, staging)
        for name, val in zip(self.past_names, kv_in):
            io.bind_ortvalue_input(name, val)
        io.bind_output("logits", "cpu")
        for name in self.present_names:
            io.bind_output(name, self.device, self.config.device_id)
        sess.run_with_iobinding(io)
        outs = io.get_outputs()
        return self.select(outs[0].numpy(), positions), list(outs[1:])

    # --- slot rows ------------------------------------------------------------------------------------------
    def slot_values(self, slots: int, capacity: int) -> list[Any]:
        kvh, hd = self.kv_shape
        return [self.kv_value((slots, kvh, capacity, hd)) for _ in self.past_names]

    def copy_rows(self, values: list[Any], src: int, into: list[Any], dst: int, n: int, capacity: int) -> None:
        """CUDA: :meth:`copy_rows_on_device`, complete before the next pass runs (rows in host memory are copied by the
        slot cache itself)."""
        if self.device == "cpu":
            raise EngineLoadError("the CPU provider's rows are host memory: the slot cache copies them")
        self.copy_rows_on_device(values, src, into, dst, n, capacity)

    def run_rows(self, feeds: dict[str, np.ndarray], values: list[Any], first_row: int, rows: int, capacity: int,
                 positions: np.ndarray, staging: Any, bindings: dict[Any, Any] | None = None) -> np.ndarray:
        """Rows bound in place through IOBinding pointers (a C-contiguous buffer's rows are tensors of their own).

        ``bindings``: the caller's (one slot cache's) IOBindings by graph and row range, each with its KV rows bound
        once: a step rebinds only the host feeds and the logits (60 pointer bindings fewer per SmolLM2 step), and
        the logits land in a fresh host array where their shape is known (a ``logits_positions`` graph), so nothing
        wraps the other outputs. On the CPU provider; CUDA binds everything afresh each pass."""
        feeds = self.position_feeds(feeds, positions)
        sess = self.session_for(feeds)
        key = (id(sess), first_row, rows)
        if self.device != "cpu":  # CUDA binds afresh each pass, as before (reuse unmeasured on a GPU)
            bindings = None
        io = None if bindings is None else bindings.get(key)
        if io is None:
            io = sess.io_binding()
            io.bind_output("logits", "cpu")  # first: get_outputs() lists outputs in binding order
            kvh, hd = self.kv_shape
            shape, elem, row = [rows, kvh, capacity, hd], _ONNX_TYPES[str(self.kv_dtype)], self.kv_row_bytes(capacity)
            for past, present, val in zip(self.past_names, self.present_names, values):
                ptr = val.data_ptr() + first_row * row
                io.bind_input(past, self.device, self.config.device_id, elem, shape, ptr)
                io.bind_output(present, self.device, self.config.device_id, elem, shape, ptr)  # written in place
            if bindings is not None:
                bindings[key] = io
        self.bind_host_inputs(io, feeds, staging)
        out = self._logits_out.get(id(sess)) if self.has_logits_positions and bindings is not None else None
        if out is None:
            io.bind_output("logits", "cpu")
        else:
            logits = np.empty((rows, positions.shape[1], out[1]), out[0])
            io.bind_output("logits", "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
        sess.run_with_iobinding(io)
        return self.select(io.get_outputs()[0].numpy(), positions) if out is None else logits
