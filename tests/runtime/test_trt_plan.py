"""TensorRT planning without TensorRT: optimization profiles, profile choice, buffer sizes, engine compatibility."""
from __future__ import annotations

import pytest

from trtinfer.errors import ConfigError, EngineLoadError
from trtinfer.runtime.trt_plan import (
    DimRange,
    ProfilePlan,
    check_compatible,
    compatibility_problem,
    dim_ranges,
    plan_profiles,
    select_profile,
)

# the I/O of a tensorrt-target graph (scatter_buffer layout): 2 layers, 2 KV heads, head dim 16, 64 KV slots
IO = {
    "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
               {"name": "position_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
               {"name": "logits_positions", "dtype": "int64", "shape": ["batch", "positions"]},
               *({"name": f"past_key_values.{i}.{kv}", "dtype": "float16", "shape": ["batch", 2, 64, 16]}
                 for i in range(2) for kv in ("key", "value"))],
    "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "positions", 320]}],
}


def test_profiles_cover_prefill_and_decode():
    plan = plan_profiles(IO["inputs"], max_batch=8, max_seq=64, opt_batch=4, opt_seq=32)
    assert [p.name for p in plan.profiles] == ["prefill", "decode"]
    pre, dec = plan.profiles
    assert pre.shapes["input_ids"] == ((1, 1), (4, 32), (8, 64))
    assert pre.shapes["logits_positions"] == ((1, 1), (4, 1), (8, 64))  # scoring asks for every position
    assert dec.shapes["input_ids"] == ((1, 1), (4, 1), (8, 1))
    assert dec.shapes["past_key_values.0.key"] == ((1, 2, 64, 16), (4, 2, 64, 16), (8, 2, 64, 16))


def test_default_opt_shapes_are_capped():
    dims = dim_ranges(max_batch=16, max_seq=4096)
    assert dims["prefill"]["batch"] == DimRange(1, 8, 16)
    assert dims["prefill"]["sequence"] == DimRange(1, 512, 4096)
    assert dims["decode"]["sequence"] == DimRange(1, 1, 1)


@pytest.mark.parametrize("kw, flag", [({"opt_batch": 9}, "--opt-batch-size"), ({"opt_seq": 65}, "--opt-seq-len"),
                                      ({"opt_batch": 0}, "--opt-batch-size")])
def test_opt_shapes_outside_the_limits_are_refused(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        plan_profiles(IO["inputs"], max_batch=8, max_seq=64, **kw)


def test_an_onnxruntime_layout_graph_is_refused_by_name():
    inputs = [*IO["inputs"], {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "total_sequence"]}]
    with pytest.raises(ConfigError, match="attention_mask has dimension 'total_sequence'.*--target tensorrt"):
        plan_profiles(inputs, max_batch=8, max_seq=64)


def test_a_step_picks_its_profile():
    plan = plan_profiles(IO["inputs"], max_batch=8, max_seq=64)
    kv = (3, 2, 64, 16)
    decode = {"input_ids": (3, 1), "position_ids": (3, 1), "logits_positions": (3, 1), "past_key_values.0.key": kv}
    prefill = {"input_ids": (3, 20), "position_ids": (3, 20), "logits_positions": (3, 1), "past_key_values.0.key": kv}
    one_token_scored = {**decode, "logits_positions": (3, 1)}
    assert select_profile(plan, decode) == plan.index("decode")
    assert select_profile(plan, prefill) == plan.index("prefill")
    assert select_profile(plan, one_token_scored) == plan.index("decode")
    with pytest.raises(ValueError, match="no optimization profile"):
        select_profile(plan, {**prefill, "input_ids": (9, 20)})  # batch above the max


def test_plan_survives_its_json_form():
    plan = plan_profiles(IO["inputs"], max_batch=8, max_seq=64, opt_batch=2, opt_seq=16)
    again = ProfilePlan.from_list(plan.to_list())
    assert again == plan



def test_engine_compatibility():
    built = {"tensorrt_version": "10.15.1", "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    assert compatibility_problem(built, dict(built)) is None
    assert compatibility_problem(built, {**built, "gpu": "NVIDIA H100 PCIe"}) is None  # same architecture
    assert "TensorRT 10.15.1, this is TensorRT 10.16.0" in compatibility_problem(
        built, {**built, "tensorrt_version": "10.16.0"})
    with pytest.raises(EngineLoadError, match=r"built for NVIDIA H100.*compute capability 9.0.*8.9\).*rebuild"):
        check_compatible(built, {**built, "gpu": "NVIDIA L4", "compute_capability": "8.9"}, "eng")
