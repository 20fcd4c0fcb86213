"""benchmarks/load_peak.py: one measurement of a real (tiny) engine with this checkout's runtime."""
from __future__ import annotations

from pathlib import Path

from benchmarks import load_peak
from trtinfer.runtime.memory import weight_bytes

ROOT = Path(__file__).resolve().parent.parent


def test_measure_runs_the_engine_and_reports_its_peak(tiny_engine):
    engine = tiny_engine("llama", precision="int4")  # MatMulNBits: the packed weights this is about
    res = load_peak.measure(engine, ROOT, prompt_len=8, new_tokens=4)
    size = weight_bytes(engine / "model.onnx")
    assert size > 0
    # the process held the runtime and the engine: more than the weights, less than a few GiB for a tiny model
    assert size / 2**20 < res["peak_rss_mib"] < 4096
    assert res["decode_tok_s"] > 0 and len(res["first_tokens"]) == 4
