"""Memory facts the runtime and the build stages act on: what is available, and what a graph's weights take.

ONNX Runtime memory-maps a graph's external data when it loads with graph optimization off (as every trtinfer
session does after the build), so a model's weights are file pages shared with the page cache, not a copy. Then
MLAS *prepacks* the weights of fp32 GEMMs into its own layout: a second, private copy of nearly every weight (on
Gemma-3-270M fp32, peak 1,822 vs 1,379 MiB without it), which pays at batch > 1 (bs8 decode 2.4x faster here) but
cannot exist for a model larger than RAM. :func:`lean_weights` turns prepacking off for graphs whose weights take
more than half the memory available: the weights are then read once, in place. Where prepacking stays on, the
mapped originals are paged out while the session loads (:mod:`trtinfer.runtime.page_out`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: prepacking is turned off when a graph's weights exceed this share of the available memory
LEAN_SHARE = 0.5
#: ONNX Runtime's session setting that turns MLAS prepacking off ("1")
PREPACK_OFF = "session.disable_prepacking"


def proc_kib(path: str, key: str) -> int | None:
    """The kB figure of line ``key:`` in a /proc file (``/proc/meminfo``, ``/proc/self/status``...), or None where
    the file or the line is absent (not Linux)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) for line in lines if line.startswith(key + ":")), None)


def available_memory() -> int | None:
    """Bytes of memory available to new allocations now (``MemAvailable``), or None where unknown."""
    kib = proc_kib("/proc/meminfo", "MemAvailable")
    return None if kib is None else kib * 1024


def fits_in_memory(nbytes: int) -> bool:
    """Whether ``nbytes`` stay within :data:`LEAN_SHARE` of the memory available now (True where unknown)."""
    avail = available_memory()
    return avail is None or nbytes <= LEAN_SHARE * avail


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB. VmHWM belongs to the process image; ``ru_maxrss`` (the
    fallback off Linux) would carry a parent's peak over across fork+exec."""
    kib = proc_kib("/proc/self/status", "VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0


def children_peak_rss_mib() -> float:
    """The largest peak resident memory of this process's finished children so far, MiB (``ru_maxrss`` of
    ``RUSAGE_CHILDREN``: the export's child interpreters); 0 where none ran or off POSIX."""
    try:
        import resource
    except ImportError:
        return 0.0
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0


@functools.lru_cache(maxsize=1)
def libc_madvise() -> Any:
    """libc's ``madvise``, or None where there is no C library to load it from."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def return_freed_memory() -> None:
    """Free unreachable cycles, then hand the heap's freed pages back to the system (glibc ``malloc_trim``; a no-op
    elsewhere). A trace leaves hundreds of MB freed but held by the allocator; the fp32 eager model loaded after it
    would stack on top. The cycle collector runs first: an onnx_ir graph is a web of reference cycles (values know
    their nodes and uses), freed only by it."""
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        log.debug("malloc_trim is not available here")


def weight_bytes(model: Path) -> int:
    """Bytes of the graph file plus the external-data files beside it (``<name>.data``, ``*.data``)."""
    files = {Path(model)} | set(Path(model).parent.glob("*.data"))
    return sum(f.stat().st_size for f in files if f.is_file())


def lean_weights(options: Any, model: Path, *, always: bool = False) -> bool:
    """Turn MLAS prepacking off in ``options`` (``onnxruntime.SessionOptions``) when ``model``'s weights take more
    than :data:`LEAN_SHARE` of the available memory, or ``always`` (a check that runs a graph a few times gains
    nothing from a packed copy); returns whether it did."""
    if not always:
        size = weight_bytes(model)
        if fits_in_memory(size):
            return False
        log.info("%s: weights of %.1f GiB vs %.1f GiB available: weights are read in place (no prepacked copy)",
                 Path(model).name, size / 2**30, (available_memory() or 0) / 2**30)
    options.add_session_config_entry(PREPACK_OFF, "1")
    return True


def prepacks(options: Any) -> bool:
    """Whether a session made with ``options`` (``onnxruntime.SessionOptions``) lets MLAS pack its weights."""
    try:
        return bool(options.get_session_config_entry(PREPACK_OFF) != "1")
    except RuntimeError:  # never set: on
        return True


def stage_session_options(model: Path, *, always: bool = False) -> Any:
    """``onnxruntime.SessionOptions`` for running a build stage's graph (a check, a reference, calibration): quiet,
    and where :func:`lean_weights` applies, unfused too, so ONNX Runtime maps the weights and copies none."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if lean_weights(so, model, always=always):
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


def whole_copy_fits(need: int, where: Path) -> tuple[bool, str]:
    """Whether a whole fp32 copy of a stage's graph (``need`` bytes of weights) fits: within the memory share a graph
    may take (:func:`fits_in_memory`) and on the disk holding ``where``; and the figures, for a person."""
    import shutil

    free = shutil.disk_usage(where).free
    avail = available_memory()
    figures = (f"the fp32 graph needs {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB of disk free"
               + (f", {avail / 2**30:.1f} GiB of memory available" if avail is not None else ""))
    return fits_in_memory(need) and need < 0.9 * free, figures
