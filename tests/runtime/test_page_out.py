"""runtime.page_out: a session's mapped weight pages are handed back (while it loads where MLAS packs them row by row),
and nothing it computes changes."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtinfer.runtime.memory import PREPACK_OFF, prepacks
from trtinfer.runtime.page_out import cpu_session, data_files, mapped_ranges, page_out, paging_out

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise are Linux's")


def resident_kib(files: set[str]) -> int:
    """Resident kB of this process's mappings of ``files`` (/proc/self/smaps)."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head[0].split("-")) == 2 and ":" not in head[0]:
                current = len(head) == 6 and head[5].rstrip("\n") in files
            elif current and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def int4_graph(folder: Path, k: int = 2048, n: int = 2048, block: int = 32) -> Path:
    """y = x @ W, W a seeded 4-bit blockwise weight (MatMulNBits, int8 compute as the int4 engines use) in an
    external-data file: MLAS packs it when the session loads."""
    rng = np.random.default_rng(0)
    blocks = k // block
    b = rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8)
    scales = (rng.random(n * blocks, dtype=np.float32) * 0.02 + 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "b", "scales"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=4)
    graph = helper.make_graph(
        [node], "int4",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    # written back now: MADV_PAGEOUT does not reclaim dirty page-cache pages, and a just-written file's may still be
    # dirty when the session maps it (the test once kept all 512 KiB resident in a CI run on a loaded machine)
    with open(folder / "model.onnx.data", "rb+") as f:
        os.fsync(f.fileno())
    return path


def options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as the runtime loads: weights mapped
    return so


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), options(), providers=["CPUExecutionProvider"])


def test_weights_paged_out_while_loading_and_results_unchanged(tmp_path):
    path = int4_graph(tmp_path)
    files = data_files(tmp_path)
    assert files == {os.path.realpath(tmp_path / "model.onnx.data")}
    x = np.random.default_rng(1).standard_normal((3, 2048)).astype(np.float32)

    kept = session(path)
    expected = kept.run(None, {"x": x})[0]
    held = resident_kib(files)
    assert mapped_ranges(files), "ONNX Runtime maps the external data: the premise of paging it out"
    # ONNX Runtime unmaps the packed 4-bit blocks but keeps the scales (512 KiB here) mapped and resident, though the
    # packed copy holds them too (a 1B engine: 154 MiB of scales)
    assert held >= 512, held
    if page_out(files) == 0:
        pytest.skip("this kernel refuses MADV_PAGEOUT (Linux < 5.4): paging out does nothing here")
    del kept

    lean = cpu_session(str(path), options(), tmp_path)  # prepacking on: paged out while it loads
    assert resident_kib(files) < held / 4  # handed back
    np.testing.assert_array_equal(lean.run(None, {"x": x})[0], expected)  # the packed copy computes the same
    assert page_out(files) >= 0  # again, after running: still nothing lost
    np.testing.assert_array_equal(lean.run(None, {"x": x})[0], expected)


def test_only_packing_cpu_sessions_page_out(tmp_path):
    path = int4_graph(tmp_path)
    files = data_files(tmp_path)
    so = options()
    assert prepacks(so)
    so.add_session_config_entry(PREPACK_OFF, "1")
    assert not prepacks(so)
    lean = cpu_session(str(path), so, tmp_path)  # weights read in place on every run: nothing to page out
    lean.run(None, {"x": np.ones((1, 2048), np.float32)})
    assert resident_kib(files) >= 1024  # the 4-bit blocks, read where they are mapped


def test_nothing_to_page_out_is_a_no_op(tmp_path):
    assert data_files(tmp_path) == set()
    with paging_out(set()):
        pass
    assert page_out({str(tmp_path / "absent.data")}) == 0


def test_pages_stay_while_a_float_graph_loads(tmp_path):
    """Without ``while_loading`` (a graph whose float GEMM weights MLAS packs in column panels, each page read again
    by many panels) nothing is paged out during the block, so no page is faulted back from the file between two
    panels; everything is paged out when it ends. With it, the helper hands pages back during the block."""
    import time

    int4_graph(tmp_path)
    files = data_files(tmp_path)
    data = np.memmap(tmp_path / "model.onnx.data", mode="r")  # a mapping of the weights, as ONNX Runtime's
    size_kib = data.nbytes // 1024
    if page_out(files) == 0:
        pytest.skip("this kernel refuses MADV_PAGEOUT (Linux < 5.4): paging out does nothing here")
    with paging_out(files, while_loading=False):
        int(data.sum())  # every page read, as a packing pass reads them
        time.sleep(0.1)  # ten passes of a page-out while loading
        during = resident_kib(files)
    assert during >= 0.9 * size_kib, (during, size_kib)
    assert resident_kib(files) < during / 4  # handed back once loaded
    with paging_out(files):  # while loading
        int(data.sum())
        time.sleep(0.1)
        assert resident_kib(files) < during / 4


def test_engines_page_out_while_loading_only_where_every_weight_is_matmulnbits():
    from trtinfer.artifact import Manifest
    from trtinfer.runtime.ort_env import row_packed

    def manifest(precision: str, **config):
        return Manifest({"precision": precision, "quantization": {"config": config}})

    assert row_packed(manifest("int4")) and row_packed(manifest("int8")) and row_packed(manifest("gguf"))
    assert not row_packed(manifest("fp32")) and not row_packed(manifest("fp16")) and not row_packed(manifest("int8-static"))
    assert not row_packed(manifest("int4", keep_fp32=["lm_head"]))  # an fp32 MatMul left: packed in column panels
    assert not row_packed(manifest("int8", exclude=["down_proj"]))
    assert not row_packed(manifest("int4"), "prefill")  # the int8 prefill graph's MatMulInteger weights: column panels
