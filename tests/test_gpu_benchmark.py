"""benchmarks/gpu.py and the GPU pieces of trtinfer.bench, on the CPU: the script refuses cleanly without a GPU; its
row assembly, table and chart, the GPU memory probe (a fake nvidia-smi) and the worker's CPU path are checked on
hand-made data and a tiny engine. The GPU measurements themselves need a GPU and are not run here."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trtinfer.bench import BenchResult, GpuMemory, compare, measure_eager, measure_engine, ratios
from trtinfer.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu = _load_script()


def _result(decode: float, ttft: float, rss: float = 500.0, first: list[int] | None = None,
            gpu_mem: dict[str, Any] | None = None) -> dict[str, Any]:
    r = {"system": "x", "batch_size": 1, "prompt_len": 128, "new_tokens": 64, "ttft_ms": ttft, "decode_tok_s": decode,
         "peak_rss_mib": rss, "first_tokens": first or [1, 2, 3]}
    return r if gpu_mem is None else {**r, "gpu": gpu_mem}


SMI = "nvidia-smi used_memory of this process"


def _hand_made() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    eagers = [
        {"model": "m", "batch_size": 1, "dtype": "fp16", "result": _result(100.0, 20.0, gpu_mem={
            "used_mib": 1000.0, "method": SMI, "torch_max_memory_allocated_mib": 400.0})},
        {"model": "m", "batch_size": 1, "dtype": "fp32", "result": _result(80.0, 25.0, first=[9, 9])},
    ]
    engines = [
        {"model": "m", "batch_size": 1, "backend": "onnxruntime", "precision": "fp16",
         "result": _result(300.0, 5.0, gpu_mem={"used_mib": 500.0, "method": SMI})},
        {"model": "m", "batch_size": 8, "backend": "onnxruntime", "precision": "fp32", "result": _result(900.0, 9.0)},
    ]
    return engines, eagers


@pytest.mark.skipif(gpu.gpu_missing(gpu.BACKENDS) is None, reason="a CUDA GPU is visible: the script would run")
def test_refuses_without_gpu(tmp_path: Path) -> None:
    out = tmp_path / "results" / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--models", "smollm2-135m", "--out", str(out)],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # not even the results folder


def test_assemble_rows_ratios_per_eager_dtype() -> None:
    engines, eagers = _hand_made()
    rows = gpu.assemble_rows(engines, eagers)
    assert [(r["batch_size"], r["precision"]) for r in rows] == [(1, "fp16"), (8, "fp32")]
    q = rows[0]["ratios_vs_eager"]
    assert set(q) == {"fp16", "fp32"}
    assert q["fp16"] == {"decode": 3.0, "ttft": 0.25, "peak_rss": 1.0, "same_first_tokens": True, "gpu_used": 0.5}
    assert q["fp32"]["decode"] == 3.75 and q["fp32"]["same_first_tokens"] is False
    assert "gpu_used" not in q["fp32"]  # eager fp32 has no GPU figure: no ratio of unlike measurements
    assert rows[1]["ratios_vs_eager"] == {}  # no eager measured at bs8


def test_gpu_used_ratio_needs_the_same_method() -> None:
    eng = _result(1, 1, gpu_mem={"used_mib": 500.0, "method": "a"})
    assert "gpu_used" not in gpu.engine_ratios(eng, _result(1, 1, gpu_mem={"used_mib": 900.0, "method": "b"}))
    assert gpu.engine_ratios(eng, _result(1, 1, gpu_mem={"used_mib": 1000.0, "method": "a"}))["gpu_used"] == 0.5


def test_format_table() -> None:
    engines, eagers = _hand_made()
    table = gpu.format_table(gpu.assemble_rows(engines, eagers), eagers)
    lines = table.splitlines()
    assert "decode × eager fp16" in lines[0] and "TTFT × eager fp32" in lines[0]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert len(lines) == 2 + 2 + 2  # header, rule, two eager rows, two engine rows
    assert "| m | PyTorch eager fp16 | 1 | 20.0 | 100.0 |" in lines[2] and "1000 (alloc 400)" in lines[2]
    fp16 = next(line for line in lines if "onnxruntime fp16" in line)
    assert "| 3.00 | 3.75 | 0.25 | 0.20 | 500 |" in fp16 and "fp16: yes, fp32: no" in fp16
    bs8 = next(line for line in lines if "onnxruntime fp32" in line)
    assert "| – | – | – | – | ? |" in bs8  # no eager at bs8, no GPU figure


def test_engine_plan() -> None:
    both = list(gpu.BACKENDS)
    assert gpu.engine_plan(["fp16", "fp32"], both, trt_ok=True) == [
        ("onnxruntime", "fp16"), ("onnxruntime", "fp32"), ("tensorrt", "fp16")]
    assert gpu.engine_plan(["fp16", "fp32"], both, trt_ok=False) == [("onnxruntime", "fp16"), ("onnxruntime", "fp32")]
    assert gpu.engine_plan(["fp32"], ["tensorrt"], trt_ok=True) == [("tensorrt", "fp16")]


def test_tensorrt_skip_reason_here() -> None:
    reason = gpu.tensorrt_unavailable()
    if reason is None:
        pytest.skip("TensorRT and a GPU are here")
    assert "TensorRT" in reason


def test_parse_args_defaults() -> None:
    a = gpu.parse_args([])
    assert (a.models, a.batch_sizes, a.precisions, a.eager_dtypes) == (
        ["smollm2-135m", "gemma-3-270m"], [1, 8], ["fp16", "fp32"], ["fp16", "fp32"])
    assert (a.backends, a.prompt_len, a.new_tokens) == (["onnxruntime", "tensorrt"], 128, 64)
    out = Path(a.out)  # named by what, where and when: results/gpu_<machine kind>_<date>.json
    assert out.parent.name == "results" and out.name.startswith("gpu_") and out.suffix == ".json"


def test_chart_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    engines, eagers = _hand_made()
    path = tmp_path / "gpu.png"
    gpu.chart(gpu.assemble_rows(engines, eagers), eagers, path, "Test GPU")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- trtinfer.bench -----------------------------------------------------------------------------------------------
def test_bench_result_dict_keeps_cpu_shape() -> None:
    r = BenchResult("s", 1, 8, 4, 1.0, 2.0, 3.0, [1])
    assert "gpu" not in r.to_dict()
    assert BenchResult(**r.to_dict()) == r
    g = BenchResult("s", 1, 8, 4, 1.0, 2.0, 3.0, [1], {"used_mib": 5.0, "method": "m"})
    assert g.to_dict()["gpu"] == {"used_mib": 5.0, "method": "m"} and BenchResult(**g.to_dict()) == g


def test_ratios() -> None:
    assert ratios(_result(30, 10, 300), _result(10, 20, 600)) == {
        "decode": 3.0, "ttft": 0.5, "peak_rss": 0.5, "same_first_tokens": True}


@pytest.mark.parametrize(("kw", "match"), [({"eager_dtype": "fp8"}, "eager dtype"),
                                           ({"eager_device": "gpu"}, "eager device"),
                                           ({"new_tokens": 1}, "new_tokens")])
def test_compare_refuses_bad_settings_before_running(tmp_path: Path, kw: dict[str, Any], match: str) -> None:
    with pytest.raises(InputError, match=match):
        compare(tmp_path / "none", **kw)


def test_measure_refuses_bad_provider_and_device(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="provider"):
        measure_engine(tmp_path, provider="rocm")
    with pytest.raises(InputError, match="eager device"):
        measure_eager(tmp_path, device="cuda:x")


def _fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_mib: str | None) -> Path:
    """An ``nvidia-smi`` on PATH: device memory.used from a file; compute apps list this process when ``own_mib``."""
    used = tmp_path / "used"
    used.write_text("1000\n")
    own = f'echo "$PPID, {own_mib}"; ' if own_mib is not None else ""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f'#!/bin/sh\ncase "$*" in\n  *query-compute-apps*) {own}echo "1, 777";;\n'
                   f'  *memory.used*) cat "{used}";;\nesac\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    return used


def test_gpu_memory_reads_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path, monkeypatch, own_mib="1234")
    got = GpuMemory().result()
    assert got["used_mib"] == 1234.0 and "of this process" in got["method"]


def test_gpu_memory_falls_back_to_device_delta(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    used = _fake_smi(tmp_path, monkeypatch, own_mib=None)  # a container: the driver lists no process of ours
    probe = GpuMemory()
    used.write_text("1600\n")
    got = probe.result()
    assert got["used_mib"] == 600.0 and "after the runs minus before" in got["method"]


def test_gpu_memory_without_any_tool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi; cuda-python absent or no GPU here
    got = GpuMemory().result()
    if got["used_mib"] is not None:
        pytest.skip("cuda-python found a GPU")
    assert got == {"used_mib": None, "method": None}


def test_cpu_compare_unchanged_on_tiny_engine(tiny_engine) -> None:
    """The CPU path through the worker's (extended) argv: same keys as before, no ``gpu`` entry."""
    engine = tiny_engine("llama")
    rep = compare(engine, 1, 8, 4)
    assert [r["system"] for r in rep["results"]] == [f"trtinfer {engine.name}", "pytorch eager"]
    assert all("gpu" not in r for r in rep["results"])
    assert set(rep["ratios_vs_eager"]) == {"decode", "ttft", "peak_rss", "same_first_tokens"}
    assert rep["ratios_vs_eager"]["same_first_tokens"]
    json.dumps(rep)


def test_main_plumbing_with_stubbed_measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU run's bookkeeping (grid, TensorRT skip, failures, JSON, chart) with the measurements stubbed out."""
    pytest.importorskip("matplotlib")
    calls: list[tuple[Any, ...]] = []

    def fake_compare(engine: Path, bs: int, pl: int, nt: int, eager: bool, provider: str | None) -> dict[str, Any]:
        calls.append(("engine", engine.name, bs, eager, provider))
        if engine.name.endswith("fp32") and bs == 8:
            raise gpu.TrtInferError("engine benchmark failed: out of memory")
        return {"engine": str(engine), "results": [_result(200.0 * bs, 5.0)]}

    def fake_eager(engine: Path, bs: int, pl: int, nt: int, device: str, dtype: str) -> BenchResult:
        calls.append(("eager", engine.name, bs, device, dtype))
        return BenchResult(**_result(50.0 * bs, 20.0))

    monkeypatch.setattr(gpu, "gpu_missing", lambda backends: None)
    monkeypatch.setattr(gpu, "tensorrt_unavailable", lambda: "no TensorRT here")
    monkeypatch.setattr(gpu, "build_engine", lambda m, b, p: (tmp_path / f"{m}-{b}-{p}", {"seconds": 1.0}))
    monkeypatch.setattr(gpu, "compare", fake_compare)
    monkeypatch.setattr(gpu, "measure_eager", fake_eager)
    monkeypatch.setattr(gpu, "gpu_info", lambda: {"gpu": "Fake GPU"})
    out = tmp_path / "res" / "gpu.json"
    assert gpu.main(["--models", "m", "--batch-sizes", "1", "8", "--out", str(out)]) == 1  # one failure
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert data["skipped"] == [{"backend": "tensorrt", "reason": "no TensorRT here"}]
    assert [f["what"] for f in data["failures"]] == ["m onnxruntime fp32 bs8"]
    assert [(r["precision"], r["batch_size"]) for r in data["rows"]] == [("fp16", 1), ("fp32", 1), ("fp16", 8)]
    assert data["rows"][0]["ratios_vs_eager"]["fp16"]["decode"] == 4.0
    assert data["machine"]["gpu"] == {"gpu": "Fake GPU"} and "cpu_flags" in data["machine"]
    assert ("eager", "m-onnxruntime-fp16", 1, "cuda", "fp32") in calls
    assert all(c[4] == "cuda" for c in calls if c[0] == "engine")  # ONNX Runtime engines on the CUDA provider
    assert all(c[3] is False for c in calls if c[0] == "engine")  # eager once per model, batch and dtype
