"""ONNX Runtime's GPU options, checked on the CPU: the providers list each RuntimeConfig asks for, the one-line error
where a GPU provider is missing, and per-generation ownership of the host staging buffers.

The staging logic is GPU code, but only its allocator is: ``_cpu_staging`` gives a CPU session a CPU allocator in its
place, so the same buffers are made, bound, handed from cache to cache and freed through real runs here.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from concurrency import assert_concurrent_equals_sequential

import trtinfer
from trtinfer.artifact import Manifest, read_manifest
from trtinfer.errors import BackendUnavailableError, ConfigError
from trtinfer.runtime.config import RuntimeConfig
from trtinfer.runtime.ort_env import PinnedInputs, ort_providers, trt_cache_paths
from trtinfer.runtime.ort_session import OrtDecoderSession
from trtinfer.runtime.slots import SlotCache

PROMPTS = ["The history of the city", "Hello", "A quick brown fox jumps over the lazy dog while the cat"]
OTHER = ["Once upon a time", "What is the capital of"]


@pytest.fixture(scope="module")
def engine(tiny_engine) -> Path:
    return tiny_engine("llama")


@pytest.fixture(scope="module")
def concat_engine(tiny_engine) -> Path:
    return tiny_engine("llama", disable_passes=("attention",))


# --- providers list -------------------------------------------------------------------------------------------
def test_cpu_and_cuda_providers(engine):
    m = read_manifest(engine)
    assert ort_providers(RuntimeConfig(), m, engine) == ["CPUExecutionProvider"]
    assert ort_providers(RuntimeConfig(provider="cuda", device_id=1), m, engine) == [
        ("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]


def test_tensorrt_providers_fall_back_to_cuda_then_cpu(engine, tmp_path):
    m = read_manifest(engine)
    cfg = RuntimeConfig(provider="tensorrt", device_id=1, trt_cache_dir=tmp_path / "trt")
    assert cfg.trt_cache_dir == str(tmp_path / "trt")  # a Path is kept as its string
    trt, cuda, cpu = ort_providers(cfg, m, engine)
    assert trt == ("TensorrtExecutionProvider", {
        "device_id": 1, "trt_engine_cache_enable": True, "trt_engine_cache_path": str(tmp_path / "trt"),
        "trt_timing_cache_enable": True, "trt_timing_cache_path": str(tmp_path / "trt"), "trt_fp16_enable": False})
    assert cuda == ("CUDAExecutionProvider", {"device_id": 1})
    assert cpu == "CPUExecutionProvider"
    assert not (tmp_path / "trt").exists(), "building the list creates nothing"


def test_tensorrt_options_follow_config_and_precision(engine, tmp_path):
    raw = read_manifest(engine).raw
    fp16 = Manifest({**raw, "precision": "fp16"})
    cfg = RuntimeConfig(provider="tensorrt", trt_cache_dir=str(tmp_path), trt_timing_cache=False,
                        trt_max_workspace_size=2 << 30)
    opts = ort_providers(cfg, fp16, engine)[0][1]
    assert opts["trt_fp16_enable"] is True
    assert opts["trt_timing_cache_enable"] is False and "trt_timing_cache_path" not in opts
    assert opts["trt_max_workspace_size"] == 2 << 30
    for precision in ("fp32", "bf16", "int4"):  # TensorRT's fp16 kernels only for fp16 engines
        opts = ort_providers(cfg, Manifest({**raw, "precision": precision}), engine)[0][1]
        assert opts["trt_fp16_enable"] is False, precision
        assert "trt_max_workspace_size" in opts


def test_engine_precision_from_manifest_or_kv_type(engine):
    raw = read_manifest(engine).raw
    assert Manifest(raw).precision == "fp32"
    stage = {k: v for k, v in raw.items() if k != "precision"}  # a stage opened for scoring: no build record
    assert Manifest(stage).precision == "fp32"
    half = json.loads(json.dumps(stage))
    for t in half["io"]["inputs"]:
        if t["name"].startswith("past_key_values."):
            t["dtype"] = "float16"
    assert Manifest(half).precision == "fp16"


def test_default_trt_cache_is_keyed_by_engine_content(engine, tmp_path):
    cfg = RuntimeConfig(provider="tensorrt")
    m = read_manifest(engine)
    engines, timing = trt_cache_paths(engine, m, cfg)
    assert timing == Path(os.environ["TRTINFER_CACHE"]) / "ort-trt"  # the suite's cache (conftest)
    assert engines.parent == timing
    assert trt_cache_paths(engine, m, cfg) == (engines, timing), "the key is stable"
    assert trt_cache_paths(engine, Manifest({**m.raw, "precision": "fp16"}), cfg)[0] != engines
    copy = tmp_path / "engine"
    shutil.copytree(engine, copy)
    decoder = copy / m.files["decoder"]
    st = decoder.stat()
    os.utime(copy / m.files["decoder"], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place
    assert trt_cache_paths(copy, m, cfg)[0] != trt_cache_paths(engine, m, cfg)[0]
    assert not engines.exists()


@pytest.mark.parametrize(("field", "value", "words"), [
    ("provider", "trt", "provider must be one of ('cpu', 'cuda', 'tensorrt')"),
    ("trt_max_workspace_size", -1, "trt_max_workspace_size must be >= 0"),
    ("trt_max_workspace_size", 1.5, "trt_max_workspace_size must be an integer"),
    ("trt_timing_cache", "yes", "trt_timing_cache must be True or False"),
    ("trt_cache_dir", "", "trt_cache_dir must be a folder path or None"),
    ("trt_cache_dir", 3, "trt_cache_dir must be a folder path or None"),
])
def test_runtime_config_checks_gpu_fields(field, value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        RuntimeConfig(**{field: value})
    assert e.value.field == field


# --- a missing provider: one line ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("provider", "ep"), [("tensorrt", "TensorrtExecutionProvider"),
                                              ("cuda", "CUDAExecutionProvider")])
def test_missing_gpu_provider_is_one_line(engine, provider, ep):
    if ep in ort.get_available_providers():
        pytest.skip(f"this onnxruntime has {ep}")
    with pytest.raises(BackendUnavailableError) as e:
        trtinfer.load(engine, provider=provider)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"provider '{provider}' needs onnxruntime-gpu with {ep}; this onnxruntime offers ")
    assert msg.endswith("or use provider 'cuda' or 'cpu'" if provider == "tensorrt" else "or use provider 'cpu'")
    assert not (Path(os.environ["TRTINFER_CACHE"]) / "ort-trt").exists(), "no cache folder for a provider not there"


def test_cli_offers_tensorrt_provider(engine):
    if "TensorrtExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the TensorRT provider")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-m", "trtinfer", "generate", str(engine), "-p", "Hi", "-n", "2",
                        "--provider", "tensorrt"], check=False, capture_output=True, text=True, env=env)
    assert p.returncode == BackendUnavailableError.exit_code, p.stderr
    assert "Traceback" not in p.stderr and "invalid choice" not in p.stderr
    assert "provider 'tensorrt' needs onnxruntime-gpu with TensorrtExecutionProvider" in p.stderr.strip().splitlines()[-1]


# --- per-generation staging ---------------------------------------------------------------------------------------
def _cpu_staging(session: OrtDecoderSession) -> None:
    """Make a CPU session stage host inputs as a CUDA one does, from a CPU allocator instead of the pinned one.

    ONNX Runtime allocates OrtValues from an allocator registered with its environment; sessions use it only when
    asked to (``session.use_env_allocators``), so registering one changes nothing else in this process.
    """
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_DEVICE_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, None)
    session._stage_inputs = True
    session._staging_info = info


def _ids(eng, prompts):
    return [eng.tokenizer.encode(p) for p in prompts]


def test_cpu_caches_have_no_staging(engine):
    """The CPU path binds numpy arrays: no staging object, nothing tracked; two caches share no state."""
    with trtinfer.load(engine) as eng:
        s = eng.session
        assert not s.pinned
        a, b = SlotCache(s, 3, 96), SlotCache(s, 3, 96)
        logits_a = a.prefill_rows(0, _ids(eng, PROMPTS))
        want = a.decode({r: int(lg.argmax()) for r, lg in enumerate(logits_a)})
        a.keep(0, len(_ids(eng, PROMPTS)[0]))  # row 0 back to its prompt: its next step again gives want[0]
        logits_b = b.prefill_rows(0, _ids(eng, OTHER))
        assert a.staging is None and b.staging is None
        assert s.live_stagings() == []
        assert not {id(v) for v in a.values} & {id(v) for v in b.values}
        b.decode({r: int(lg.argmax()) for r, lg in enumerate(logits_b)})  # B's step leaves A's rows as they were
        got = a.decode({0: int(logits_a[0].argmax())})
    np.testing.assert_array_equal(got[0], want[0])


@pytest.mark.parametrize("which", ["engine", "concat_engine"])
def test_each_slot_cache_owns_its_staging(which, request):
    """Two slot caches get two staging objects, kept pass to pass; buffers are never shared; the tokens are those of
    the unstaged run; a dropped cache's buffers are freed."""
    path = request.getfixturevalue(which)
    with trtinfer.load(path) as eng:
        want = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
        s = eng.session
        _cpu_staging(s)
        assert s.pinned
        ca, cb = SlotCache(s, 3, 96), SlotCache(s, 3, 96)
        logits_a = ca.prefill_rows(0, _ids(eng, PROMPTS))
        cb.prefill_rows(0, _ids(eng, OTHER))
        a, b = ca.staging, cb.staging
        assert isinstance(a, PinnedInputs) and isinstance(b, PinnedInputs) and a is not b
        assert {id(x) for x in s.live_stagings()} == {id(a), id(b)}
        pointers = {name: val.data_ptr() for name, (_, val, _) in a.buffers.items()}
        assert not set(pointers.values()) & {val.data_ptr() for _, val, _ in b.buffers.values()}
        made = a.allocations
        ca.decode({r: int(lg.argmax()) for r, lg in enumerate(logits_a)})
        assert ca.staging is a
        if s.kv_layout == "shared_buffer":  # decode inputs keep their shapes from step to step
            ca.decode({0: 1, 2: 2})
            before = a.allocations
            ca.decode({0: 3, 2: 4})
            assert a.allocations == before
        assert a.allocations > made and len(a.buffers) <= len(s.input_names) + 1  # one buffer per input at most
        del ca, a
        gc.collect()
        assert [id(x) for x in s.live_stagings()] == [id(b)], "A's cache is gone: so is its staging"
        got = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]
        assert got == want
        gc.collect()
        assert [id(x) for x in s.live_stagings()] == [id(b)], "a finished generation holds no buffers"
        eng.close()
        assert b.buffers == {}, "close gives the live generations' buffers back"


@pytest.mark.parametrize("staged", [False, True])
def test_concurrent_generations_match_sequential(engine, staged):
    """Two threads generating at once on one session get the tokens each gets alone."""
    jobs = {0: PROMPTS, 1: OTHER}
    with trtinfer.load(engine) as eng:
        if staged:
            _cpu_staging(eng.session)
        assert_concurrent_equals_sequential(eng, jobs, rounds=3, max_new_tokens=8)
        gc.collect()
        assert eng.session.live_stagings() == []
