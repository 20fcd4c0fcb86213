"""runtime.huge_pages: the weights MLAS packs when a session loads are moved onto 2 MiB pages, only memory that is
new and resident is touched, and nothing a session computes changes."""
from __future__ import annotations

import ctypes
import errno
import mmap
import platform
import sys

import numpy as np
import pytest

from tests.runtime.test_page_out import int4_graph, options
from trtinfer.runtime import huge_pages
from trtinfer.runtime.huge_pages import HUGE, MADV_COLLAPSE, collapse_resident_memory, kernel_collapses, thp_mode
from trtinfer.runtime.memory import libc_madvise
from trtinfer.runtime.page_out import cpu_session


def _kernel() -> tuple[int, ...]:
    return tuple(int(p) for p in platform.release().split("-")[0].split(".")[:2] if p.isdigit())


pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() != "madvise" or _kernel() < (6, 1),
    reason="collapsing is for Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages in 'madvise' mode (in 'always' "
           "the kernel backs the buffers with huge pages itself)")


def huge_kib_of(address: int) -> int:
    """AnonHugePages (kB) of the mapping that holds ``address`` (the kernel merges neighbouring anonymous mappings:
    a new one may share its entry with an older one)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                found = start <= address < end
            elif found and head[0] == "AnonHugePages:":
                return int(head[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def fresh_mapping(nbytes: int, touched: float) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of ``nbytes`` (plain 4 KiB pages: never advised) with its first ``touched`` share
    written; and its start address."""
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(buf, np.uint8)
    view[: int(nbytes * touched)] = 1
    address = view.ctypes.data
    del view
    return buf, address


def test_a_resident_mapping_is_collapsed_and_keeps_its_contents():
    buf, address = fresh_mapping(64 << 20, 1.0)
    buf[12345] = 7
    assert huge_kib_of(address) == 0  # THP in madvise mode (or always, without a huge-aligned start): not yet
    done = collapse_resident_memory()  # this mapping, and whatever else of the process qualifies
    assert done >= (64 << 20) - 2 * HUGE and huge_kib_of(address) * 1024 >= (64 << 20) - 2 * HUGE  # but unaligned ends
    assert buf[12345] == 7 and buf[0] == 1 and buf[(64 << 20) - 1] == 1
    buf.close()


def test_the_kernel_is_asked_once_whether_it_collapses():
    """An empty range is how a kernel is asked: one with MADV_COLLAPSE (6.1+, as here) accepts it, and the same call
    with advice no kernel knows is refused, which is what a kernel without MADV_COLLAPSE answers."""
    madvise = libc_madvise()
    assert madvise is not None and kernel_collapses()
    assert madvise(0, 0, 1 << 20) != 0 and ctypes.get_errno() == errno.EINVAL


def test_a_range_the_kernel_refuses_does_not_stop_the_others(monkeypatch):
    """MADV_COLLAPSE refuses some ranges with EINVAL on a kernel that has it: here one never written, only read (no
    written page in any of its 2 MiB pieces); in a long-running test process a large range at the heap's addresses
    was refused too, and the loop then stopped before the session's buffers. A refusal no longer stops the ranges
    after it, and the count returned is what moved onto huge pages."""
    dense, dense_address = fresh_mapping(32 << 20, 1.0)
    never_written = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(never_written, np.uint8)
        assert int(view[::4096].sum()) == 0  # read: the zero page
        address = view.ctypes.data
        del view
        lo = -(-address // HUGE) * HUGE
        madvise = libc_madvise()
        assert madvise is not None and madvise(lo, 4 * HUGE, MADV_COLLAPSE) != 0 and ctypes.get_errno() == errno.EINVAL
        ranges = huge_pages._ranges_to_collapse
        monkeypatch.setattr(huge_pages, "_ranges_to_collapse", lambda m: iter([(lo, 4 * HUGE), *ranges(m)]))
        done = collapse_resident_memory()  # the refused range first
        assert huge_kib_of(dense_address) * 1024 >= (32 << 20) - 2 * HUGE and done >= (32 << 20) - 2 * HUGE
    finally:
        dense.close()
        never_written.close()


def test_sparse_mappings_are_left_alone_and_huge_ones_not_collapsed_again():
    dense, dense_address = fresh_mapping(32 << 20, 1.0)
    assert collapse_resident_memory() >= (32 << 20) - 2 * HUGE
    sparse, sparse_address = fresh_mapping(64 << 20, 0.25)  # collapsing it would make 48 MiB more resident
    collapse_resident_memory()
    assert huge_kib_of(sparse_address) == 0 and huge_kib_of(dense_address) * 1024 >= (32 << 20) - 2 * HUGE
    assert collapse_resident_memory() < (32 << 20) - 2 * HUGE  # the dense one is not collapsed a second time
    dense.close()
    sparse.close()


def test_a_session_with_huge_pages_computes_the_same(tmp_path):
    path = int4_graph(tmp_path, k=4096, n=16384)  # 36 MiB of blocks and scales, packed at load
    x = np.random.default_rng(1).standard_normal((3, 4096)).astype(np.float32)
    plain = cpu_session(str(path), options(), tmp_path).run(None, {"x": x})[0]
    sess = cpu_session(str(path), options(), tmp_path, huge_pages=True)
    # whatever memory its packed blocks took (new, or freed by the first session and reused), none of it is left
    # on 4 KiB pages
    assert collapse_resident_memory() < 8 << 20
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], plain)


_LOAD = """
import json, sys, trtinfer
from trtinfer.runtime.memory import proc_kib
with trtinfer.load(sys.argv[1], huge_pages=sys.argv[2] == "on") as eng:
    huge = proc_kib("/proc/self/smaps_rollup", "AnonHugePages")
    ids = eng.generate(input_ids=[[1, 504, 3458, 282, 5248, 314]], max_new_tokens=8, ignore_eos=True)[0].token_ids
print(json.dumps({"huge_kib": huge, "ids": ids}))
"""


def test_an_engine_loads_its_packed_weights_onto_huge_pages_and_generates_the_same(real_engine):
    """Each load in a fresh process (in this one, memory freed by earlier tests, once collapsed, would be reused)."""
    import json
    import subprocess

    engine = real_engine("smollm2-135m", precision="int4")
    got = {}
    for setting in ("off", "on"):
        p = subprocess.run([sys.executable, "-c", _LOAD, str(engine), setting], capture_output=True, text=True,
                           check=True, timeout=300)
        got[setting] = json.loads(p.stdout.strip().splitlines()[-1])
    # SmolLM2's int4 MatMulNBits blocks: ~140 MiB packed at load, on huge pages only with huge_pages
    assert got["on"]["huge_kib"] - got["off"]["huge_kib"] >= 100 << 10, got
    assert got["on"]["ids"] == got["off"]["ids"]
