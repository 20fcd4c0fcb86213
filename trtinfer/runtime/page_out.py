"""Hand a graph's memory-mapped weight pages back to the system while ONNX Runtime loads it.

ONNX Runtime maps each external-data tensor of a graph into memory; MLAS then *prepacks* the weights of its GEMM
kernels (MatMulNBits, fp32 MatMul) into a private copy and reads only that copy from then on. The mapped pages it
read to pack stay resident in the process until the session is finished loading, and many stay mapped after it: a
1B int4 engine (769 MiB of weights) peaked at 1,249 MiB while loading, 182 MiB of it the file's pages.
:func:`paging_out` asks the kernel to reclaim those pages (``madvise(MADV_PAGEOUT)``, Linux 5.4+) when the load is
done, and, for engines whose weights are all ``MatMulNBits`` blocks (packed row by row, each page read once), every
few milliseconds while it runs: the same engine then peaks at ~1,000 MiB. Float weights are packed in column panels
that read each page many times: paged out between two panels, a page faults back from the file again and again.

``MADV_PAGEOUT`` never loses data, which is why it is used and not ``MADV_DONTNEED``: clean file pages are
dropped (a later read faults them back in from the file: a tensor ONNX Runtime still reads in place, such as a
quantized embedding table, costs one read of the rows it touches), and anonymous pages, which a reused address
range could hold, are kept (or swapped, never discarded). Elsewhere than Linux, or where the kernel refuses the
advice, it does nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trtinfer.runtime.huge_pages import collapse_resident_memory
from trtinfer.runtime.memory import libc_madvise, prepacks

log = logging.getLogger(__name__)

#: ``madvise`` advice: reclaim these pages now (Linux 5.4+)
MADV_PAGEOUT = 21
#: seconds between two passes while a load runs
INTERVAL_S = 0.01
#: precisions whose engines' GEMM weights are all ``MatMulNBits`` blocks (unless nodes were kept in fp32), which MLAS
#: packs reading each output row's stored bytes once, in order: paging their mapped originals out while it packs
#: costs nothing. A float GEMM weight ``B [K, N]`` is packed in panels of a few columns, every page read again by
#: many panels: paged out between them, each page faults back from the file over and over (a 4096 x 151936 fp32
#: MatMul, 2.4 GB: 2.4 s to load plainly, unfinished after 10 min with the pages paged out every 10 ms). Other
#: graphs are paged out once, when loaded.
ROW_PACKED_PRECISIONS = frozenset({"int4", "int8", "gguf"})


def mapped_ranges(files: set[str]) -> list[tuple[int, int]]:
    """``(start, length)`` of every mapping of this process whose file is in ``files`` (real paths); empty where
    ``/proc/self/maps`` cannot be read."""
    out = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") in files:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end - start))
    return out


def page_out(files: set[str]) -> int:
    """Ask the kernel to reclaim the resident pages of every mapping of ``files``; how many mappings it took (0 where
    it cannot: not Linux, a kernel without ``MADV_PAGEOUT``)."""
    madvise = libc_madvise()
    if madvise is None:
        return 0
    done = 0
    for start, length in mapped_ranges(files):
        if madvise(start, length, MADV_PAGEOUT) == 0:
            done += 1
        elif ctypes.get_errno() == 22:  # EINVAL: this kernel has no MADV_PAGEOUT
            return done
    return done


def data_files(folder: Path) -> set[str]:
    """Real paths of the external-data files in ``folder`` (``*.data``): the files ONNX Runtime maps."""
    return {os.path.realpath(p) for p in Path(folder).glob("*.data")}


def cpu_session(model: str | bytes, options: Any, weights: Path, providers: Sequence[Any] = ("CPUExecutionProvider",),
                *, row_packed: bool = False, huge_pages: bool = False) -> Any:
    """``onnxruntime.InferenceSession(model, options, providers)``; when it runs on the CPU first and MLAS packs its
    weights, the weight files in folder ``weights`` are paged out once it has loaded, and, for a graph whose packed
    weights are all ``MatMulNBits`` blocks (``row_packed``, :data:`ROW_PACKED_PRECISIONS`), while it loads too
    (:func:`paging_out`); with ``huge_pages``, the packed copies are then moved onto 2 MiB pages
    (:mod:`trtinfer.runtime.huge_pages`: a session that will run many steps)."""
    import onnxruntime as ort

    first = providers[0] if providers else "CPUExecutionProvider"
    on_cpu = (first[0] if isinstance(first, tuple) else first) == "CPUExecutionProvider"
    packed = on_cpu and prepacks(options)
    with paging_out(data_files(weights) if packed else (), while_loading=row_packed):
        sess = ort.InferenceSession(model, options, providers=list(providers))
    if packed and huge_pages:
        collapse_resident_memory()
    return sess


@contextlib.contextmanager
def paging_out(files: Iterable[str], *, while_loading: bool = True) -> Iterator[None]:
    """Page out ``files``' mapped pages when the block (an ``InferenceSession`` being made) ends, and, with
    ``while_loading``, every :data:`INTERVAL_S` seconds while it runs, on a helper thread."""
    wanted = set(files)
    if not wanted or not Path("/proc/self/maps").exists():
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(INTERVAL_S):
            page_out(wanted)

    helper = threading.Thread(target=loop, name="trtinfer-page-out", daemon=True) if while_loading else None
    if helper is not None:
        helper.start()
    try:
        yield
    finally:
        if helper is not None:
            stop.set()
            helper.join()
        log.debug("paged out %d mappings of %s", page_out(wanted), sorted(wanted))
