"""Back a loaded session's packed weights with 2 MiB pages, so that a decode step streams them faster.

MLAS packs the weights of its GEMM kernels (``MatMulNBits`` blocks, fp32 ``MatMul`` panels) into private buffers
when a session loads, and every decode step then reads all of them once. With transparent huge pages in ``madvise``
mode (the default of most distributions) those buffers sit on 4 KiB pages: the CPU's hardware prefetchers stop at
every 4 KiB boundary and each page costs a TLB entry. ONNX Runtime never asks for huge pages itself, so
:func:`collapse_resident_memory` does it once a session has loaded: each private anonymous mapping that is almost
fully resident (so collapsing it fills no holes and costs no memory) and not yet on huge pages is advised
``MADV_HUGEPAGE`` and collapsed in place with ``MADV_COLLAPSE`` (Linux 6.1+; the kernel copies each 2 MiB range
into one huge page). Only whole mappings qualify, not the session's buffers alone: an allocator reuses freed memory
(an engine loaded a second time packs into the first one's), so "what the load added" cannot be told from the
mappings. In ``always`` mode the kernel gives the buffers huge pages as they fill, and nothing is done; where the
kernel refuses (older kernels, THP off, not Linux) nothing changes.

Measured on a 2-vCPU Intel Xeon (``benchmarks/huge_pages.py``, 2026-11-30): one ``MatMulNBits`` at batch 1 streams
18.1 GB/s on 4 KiB pages and 22.8 on huge pages; decode at bs1 gains 3-11% (Llama-3.2-1B shape int4 20.6 -> 22.8
tok/s), at bs8 4-5%; the collapse costs ~2.6 s of load per GiB of packed weights (the 1B int4 engine's load 2.3 ->
4.9 s): ``RuntimeConfig(huge_pages=False)`` keeps the faster load.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from trtinfer.runtime.memory import libc_madvise, proc_kib

log = logging.getLogger(__name__)

#: ``madvise`` advice: back this range with transparent huge pages on later faults
MADV_HUGEPAGE = 14
#: ``madvise`` advice: collapse this range into huge pages now (Linux 6.1+)
MADV_COLLAPSE = 25
HUGE = 2 << 20
#: mappings smaller than this are left alone: a collapse needs whole aligned 2 MiB ranges
MIN_BYTES = 4 << 20
#: a mapping is collapsed only if at least this share of it is resident: a sparse one would be filled in
MIN_RESIDENT = 0.9
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or None where it does not say."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def anonymous_mappings() -> dict[int, tuple[int, int, int]]:
    """This process's private writable anonymous mappings (the heap's included: small packed tensors live there):
    start -> (length, resident bytes, bytes on huge pages); empty where ``/proc/self/smaps`` cannot be read."""
    out: dict[int, tuple[int, int, int]] = {}
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return out
    current: tuple[int, int] | None = None
    resident = 0
    for line in lines:
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            name = head[5].strip() if len(head) == 6 else ""
            anonymous = not name or name == "[heap]" or name.startswith("[anon:")
            current = (start, end - start) if anonymous and head[1].startswith("rw") and head[1][3] == "p" else None
        elif current is not None and head and head[0] == "Rss:":
            resident = int(head[1]) * 1024
        elif current is not None and head and head[0] == "AnonHugePages:":
            out[current[0]] = (current[1], resident, int(head[1]) * 1024)
            current = None
    return out


def _ranges_to_collapse(mappings: dict[int, tuple[int, int, int]]) -> Iterator[tuple[int, int]]:
    """2 MiB-aligned ``(start, length)`` inside each mapping large and resident enough to collapse (so collapsing it
    fills no holes) that is not yet on huge pages."""
    for start, (length, resident, huge) in mappings.items():
        if resident - huge < MIN_BYTES or resident < MIN_RESIDENT * length:
            continue
        lo, hi = -(-start // HUGE) * HUGE, (start + length) // HUGE * HUGE
        if hi > lo:
            yield lo, hi - lo


def _anon_huge_bytes() -> int:
    """This process's anonymous memory on huge pages now (the kernel's one-line total, not a walk of every mapping)."""
    return (proc_kib("/proc/self/smaps_rollup", "AnonHugePages") or 0) * 1024


@functools.cache
def kernel_collapses() -> bool:
    """Whether this kernel knows ``MADV_COLLAPSE`` (Linux 6.1+): asked with an empty range, which a kernel that
    knows the advice accepts before looking at any memory and one that does not refuses with ``EINVAL``."""
    madvise = libc_madvise()
    return madvise is not None and madvise(0, 0, MADV_COLLAPSE) == 0


def collapse_resident_memory() -> int:
    """Collapse into huge pages this process's resident anonymous memory not yet on them (after a session has
    loaded: its packed weights; whether the allocator put them in new mappings or reused freed ones, as it does for
    an engine loaded again). Returns how much the process's anonymous memory on huge pages grew during the call, for
    logs and tests (another thread's memory counts too); 0 where the kernel cannot collapse.

    A range the kernel refuses does not stop the others: ``MADV_COLLAPSE`` refuses with ``EINVAL`` a 2 MiB piece
    with no written page in it (only read, the shared zero page: a mapping never written) and collapses the rest of
    the range, so what moved is read back from ``/proc/self/smaps_rollup``, not inferred from the return codes. A kernel
    without ``MADV_COLLAPSE`` is told apart once (:func:`kernel_collapses`) and nothing is advised there."""
    madvise = libc_madvise()
    # "always": the kernel gave the buffers huge pages as they filled
    if madvise is None or thp_mode() != "madvise" or not kernel_collapses():
        return 0
    t0, huge_before = time.perf_counter(), _anon_huge_bytes()
    refused: Counter[int] = Counter()
    for start, length in _ranges_to_collapse(anonymous_mappings()):
        madvise(start, length, MADV_HUGEPAGE)  # later faults in the range: huge pages too
        if madvise(start, length, MADV_COLLAPSE) != 0:
            refused[ctypes.get_errno()] += 1
    done = max(0, _anon_huge_bytes() - huge_before)
    if done or refused:
        log.debug("collapsed %.0f MiB of resident memory (packed weights) into huge pages in %.2f s; ranges refused "
                  "(errno: count): %s", done / 2**20, time.perf_counter() - t0, dict(refused) or "none")
    return done
