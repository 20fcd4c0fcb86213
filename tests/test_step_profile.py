"""benchmarks/step_profile.py on a tiny int4 engine: the bytes per projection equal the graph's initializers that the
MatMulNBits nodes read, every projection group is timed, and the profiler's op times fit inside the step."""
from __future__ import annotations

import onnx
from onnx import numpy_helper

from benchmarks import step_profile


def test_projection_bytes_and_times(tiny_engine):
    engine = tiny_engine("llama", precision="int4")
    report = step_profile.profile(engine, batch=2, past=7, steps=2)
    model = onnx.load(str(engine / "model.onnx"), load_external_data=True)
    inits = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    expected: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type == "MatMulNBits":
            group = step_profile.group_of(n.name)
            expected[group] = expected.get(group, 0) + sum(inits.get(i, 0) for i in n.input)
    got = {g: v["bytes"] for g, v in report["projections"].items()}
    assert got == expected
    assert {"q_proj", "o_proj", "gate_proj", "down_proj", "lm_head"} <= set(got)
    assert all(v["ms"] > 0 and v["gb_s"] > 0 for v in report["projections"].values())
    assert report["profiled_ms_by_op"]["MatMulNBits"] > 0
    assert 0 < report["step_ms_best"] <= report["step_ms_median"]
