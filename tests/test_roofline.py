"""benchmarks/roofline.py: the bytes a decode step reads, counted from the graph, equal an independent count from
the loaded tensors (untied fp32 and int4, tied int4 whose LM head and gather share one packed table); the
bandwidth probe runs through ONNX Runtime on a small buffer; main() on a tiny engine writes the report."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


roofline = _load_script()


def _independent_weight_bytes(engine: Path, batch: int) -> tuple[int, int]:
    """(whole, gathered): every stored tensor's loaded array size, tables named ``embed_tokens`` cut to ``batch``
    rows. Tied int4 engines share the LM head's packed table with the gather (two names over the same bytes, the
    head's first name among them): read whole, counted once."""
    refs = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    place = {t.name: tuple((e.key, e.value) for e in t.external_data if e.key != "length") or t.name
             for t in refs.graph.initializer}
    model = onnx.load(str(engine / "model.onnx"), load_external_data=True)
    used = {i for n in model.graph.node for i in n.input}
    whole = gathered = 0
    seen = set()
    for t in model.graph.initializer:
        if t.name not in used or place[t.name] in seen:
            continue
        seen.add(place[t.name])
        arr = numpy_helper.to_array(t)
        if "embed_tokens" in t.name and arr.ndim >= 2:
            gathered += arr.nbytes // arr.shape[0] * batch
        else:
            whole += arr.nbytes
    return whole, gathered


@pytest.mark.parametrize(("arch", "precision"), [("llama", "fp32"), ("llama", "int4"), ("gemma3", "int4")])
def test_decode_bytes_equal_an_independent_count(tiny_engine, arch, precision):
    engine = tiny_engine(arch, precision=precision)
    for batch in (1, 3):
        counted = roofline.decode_bytes(engine, batch, kv_len=0)
        whole, gathered = _independent_weight_bytes(engine, batch)
        assert (counted["weights_bytes"], counted["gathered_bytes"]) == (whole, gathered)
        assert counted["total"] == whole + gathered and counted["kv_bytes"] == 0
    one = roofline.decode_bytes(engine, 1)
    hidden = 64
    if precision == "fp32":  # one fp32 row of the embedding table per token
        assert one["gathered_bytes"] == hidden * 4
    if arch == "gemma3" and precision == "int4":  # tied: the head reads the shared packed table whole
        assert [t["name"] for t in one["gathered_tables"]] == ["model.model.embed_tokens.weight_gather_scales"]
        assert one["gathered_bytes"] == hidden // 32 * 4  # one row of block scales
    if arch == "llama" and precision == "fp32":  # untied: the table is only gathered from
        assert [t["name"] for t in one["gathered_tables"]] == ["model.model.embed_tokens.weight"]
    if arch == "llama" and precision == "int4":  # untied: its own table at the LM head's precision, rows gathered
        assert {t["name"] for t in one["gathered_tables"]} == {"model.model.embed_tokens.weight_q4",
                                                               "model.model.embed_tokens.weight_gather_scales"}
        assert one["gathered_bytes"] == hidden // 2 + hidden // 32 * 4  # 4-bit codes and one scale per block


def test_held_bytes_add_a_float_per_block_and_column_of_every_int8_compute_matmul(tiny_engine):
    """Beside the stored bytes, what ONNX Runtime's int8-compute kernel holds and reads: one float per block of 32
    and column of each MatMulNBits (tiny Llama int4: q/k/v and gate/up packed, o, down, the head), none for fp32."""
    import onnx

    assert roofline.decode_bytes(tiny_engine("llama", precision="fp32"), 1)["held_extra_bytes"] == 0
    engine = tiny_engine("llama", precision="int4")
    counted = roofline.decode_bytes(engine, 2, kv_len=3)
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False).graph
    shapes = [{a.name: a.i for a in n.attribute} for n in graph.node if n.op_type == "MatMulNBits"]
    assert shapes and all(s["accuracy_level"] == 4 and s["block_size"] == 32 for s in shapes)
    assert counted["held_extra_bytes"] == sum(s["N"] * (s["K"] // 32) * 4 for s in shapes)
    assert counted["total_held"] == counted["total"] + counted["held_extra_bytes"]


def test_kv_bytes_cap_sliding_layers_at_their_window(tiny_engine):
    # tiny Gemma-3: layers sliding, sliding, full; window 5; 2 KV heads of 16; fp32 KV (int4 weights)
    counted = roofline.decode_bytes(tiny_engine("gemma3", precision="int4"), batch_size=2, kv_len=10.5)
    assert counted["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * (5 + 5 + 10.5)
    counted = roofline.decode_bytes(tiny_engine("llama", precision="fp32"), batch_size=1, kv_len=7)
    assert counted["kv_bytes"] == 2 * 2 * 2 * 16 * 4 * 7  # 2 layers x (K, V) x 2 heads x 16 x fp32 x 7


def test_probe_on_a_small_buffer():
    p = roofline.probe_bandwidth(buffer_mib=4, threads=1, repeats=2)
    assert p["threads"] == 1 and p["buffer_bytes"] == 4 * 2**20
    assert {k: v["bytes"] for k, v in p["kernels"].items()} == {"read": 4 * 2**20, "gemv": 4 * 2**20,
                                                                "copy": 8 * 2**20, "add": 12 * 2**20}
    for v in p["kernels"].values():
        assert math.isfinite(v["gb_s"]) and v["gb_s"] > 0
        assert v["gb_s"] == pytest.approx(v["bytes"] / v["best_s"] / 1e9)
    # the read ceiling is the best read-only kernel, over every probe given
    q = {"kernels": {k: {**v, "gb_s": v["gb_s"] * 2} for k, v in p["kernels"].items()}}
    best = roofline.ceilings(p, q)
    assert best["read"] == max(q["kernels"]["read"]["gb_s"], q["kernels"]["gemv"]["gb_s"])
    assert best["copy"] == q["kernels"]["copy"]["gb_s"]


def test_int4_kernel_probe_on_a_small_buffer():
    """The int4 kernel's probe runs MatMulNBits over weights ONNX Runtime packed at load, checks what it computed
    (it raises otherwise) and counts the packed bytes it streamed."""
    p = roofline.probe_int4_kernel(buffer_mib=4, threads=1, repeats=2)
    columns = 4 * 2**20 // (4096 // 2 + 4096 // 32 * 4)
    assert p["threads"] == 1 and p["bytes"] == columns * (4096 // 2 + 4096 // 32 * 4)
    assert p["gb_s"] == pytest.approx(p["bytes"] / p["best_s"] / 1e9) and p["gb_s"] > 0
    assert str(columns) in p["op"] and len(p["all_gb_s"]) == 2
    # held: + a float per block and column, which is what ONNX Runtime's load really grew by (its packed copy)
    assert p["held_bytes"] == p["bytes"] + columns * 4096 // 32 * 4
    assert p["gb_s_held"] == pytest.approx(p["held_bytes"] / p["best_s"] / 1e9)


def test_int4_kernel_probe_split_into_one_session_per_thread():
    """split: the same columns in one single-thread session per thread, run at once; every part's output is checked
    (the probe raises otherwise) and the bytes are the whole matrix's."""
    p = roofline.probe_int4_kernel(buffer_mib=4, threads=2, repeats=2, split=True)
    columns = 4 * 2**20 // (4096 // 2 + 4096 // 32 * 4) // 2 * 2
    assert p["split"] and p["bytes"] == columns * (4096 // 2 + 4096 // 32 * 4)
    assert f"2 sessions of 1 thread, run at once, {columns // 2} columns each" in p["op"]
    assert p["held_bytes"] == p["bytes"] + columns * 4096 // 32 * 4 and p["gb_s"] > 0


def test_int4_kernel_holds_what_the_held_count_says():
    """ONNX Runtime's load of the int4 probe grows the process's anonymous memory by the held count (its packed
    copy: codes, scales and a float per block and column; x1.2 the stored bytes), not by the stored bytes alone: if
    ONNX Runtime packs differently, the held figures of the roofline are wrong and this fails."""
    p = roofline.probe_int4_kernel(buffer_mib=64, threads=1, repeats=1, huge_pages=False)
    if p["anon_growth_at_load_bytes"] is None:
        pytest.skip("no /proc/self/smaps_rollup")
    assert p["held_bytes"] == pytest.approx(1.2 * p["bytes"], rel=1e-3)
    assert p["anon_growth_at_load_bytes"] == pytest.approx(p["held_bytes"], rel=0.05)


def test_main_on_a_tiny_engine(tiny_engine, tmp_path):
    engine = tiny_engine("llama", precision="fp32")
    int4 = tiny_engine("llama", precision="int4")
    out = tmp_path / "roofline.json"
    roofline.main([str(engine), str(int4), "--batch-sizes", "1", "2", "--prompt-len", "8", "--new-tokens", "4",
                   "--buffer-mib", "4", "--repeats", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report) >= {"machine", "date", "git_commit", "load_average", "prompt_len", "new_tokens", "probe",
                           "probe_after", "probe_anon_huge_pages_mib", "probe_other_threads", "ceiling_gb_s", "rows"}
    assert {"cpu", "cores", "cpu_flags"} <= set(report["machine"])
    assert [(r["precision"], r["batch_size"]) for r in report["rows"]] == [("fp32", 1), ("fp32", 2), ("int4", 1),
                                                                          ("int4", 2)]
    # the int4 kernel's ceiling: the best of its probes before and after the engines with the packed blocks on huge
    # pages, as engines run (int4 rows are set against it); on 4 KiB pages and split one session per thread recorded
    probes = report["int4_kernel_probes"]
    assert [(p["huge_pages"], p["split"]) for p in probes] == [(True, False), (False, False), (True, True)] * 2
    assert all("int4" in kv for kv in report["probe_other_threads"].values())  # 1 thread, where the engine uses more
    assert report["ceiling_gb_s"]["int4"] == max(p["gb_s"] for p in probes if p["huge_pages"] and not p["split"])
    assert report["ceiling_gb_s"]["int4_4k"] == max(p["gb_s"] for p in probes if not p["huge_pages"])
    assert report["ceiling_gb_s"]["int4_split"] == max(p["gb_s"] for p in probes if p["split"])
    for r in report["rows"]:
        assert ("fraction_of_int4_kernel" in r) == (r["precision"] == "int4")
        if r["precision"] == "int4":
            assert r["fraction_of_int4_kernel"] == pytest.approx(r["achieved_gb_s"] / report["ceiling_gb_s"]["int4"])
        path = engine if r["precision"] == "fp32" else int4
        assert r["bytes_per_step"] == roofline.decode_bytes(path, r["batch_size"], 8 + 4 / 2)["total"]
        assert r["achieved_gb_s"] == pytest.approx(r["bytes_per_step"] / (r["step_ms"] / 1000) / 1e9)
        assert r["fraction_of_read"] == pytest.approx(r["achieved_gb_s"] / report["ceiling_gb_s"]["read"])
        assert np.isfinite(r["fraction_of_copy"]) and r["fraction_of_copy"] > 0
    # the read ceiling: the best read-only kernel (ReduceMax or the MLAS GEMV) before or after (after: rounded)
    reads = [report["probe"]["kernels"][k]["gb_s"] for k in roofline.READ_KERNELS]
    reads += [report["probe_after"][k] for k in roofline.READ_KERNELS]
    assert report["ceiling_gb_s"]["read"] == pytest.approx(max(reads), abs=0.01)
    assert out.with_suffix(".png").stat().st_size > 0
