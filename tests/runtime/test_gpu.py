"""CUDA execution provider: the same tokens and scores as the CPU engine. Runs only where onnxruntime-gpu sees a GPU.

fp32 CUDA engines must give the CPU engine's greedy tokens exactly. fp16/bf16 engines round differently, so a
generated sequence may part from the fp32 one where the fp32 model itself nearly ties: the first differing token
must then be one the fp32 engine rates within ``NEAR_TIE`` (log-probability) of its own choice.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from concurrency import assert_concurrent_equals_sequential

import trtinfer
import trtinfer.errors
from trtinfer.runtime.slots import SlotCache

pytestmark = pytest.mark.gpu

PROMPTS = ["The history of the city", "Hello", "A quick brown fox jumps over the lazy dog while the cat"]
NEAR_TIE = {"fp16": 0.05, "bf16": 0.3}  # fp32 log-prob gap under which fp16/bf16 may pick the other token
SCORE_ATOL = {"fp32": 2e-3, "fp16": 0.05, "bf16": 0.3}  # |log-prob CUDA - CPU fp32| per token


def _cpu(tiny_engine, arch):
    return trtinfer.load(tiny_engine(arch))


def _cuda(tiny_engine, arch, precision="fp32"):
    return trtinfer.load(tiny_engine(arch, target="cuda", precision=precision), provider="cuda")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_engine_matches_cpu(arch, tiny_engine):
    cpu = _cpu(tiny_engine, arch).generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    with _cuda(tiny_engine, arch) as eng:
        gpu = eng.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        assert eng.session.device == "cuda"
        assert eng.session.sess.get_providers()[0] == "CUDAExecutionProvider"
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_half_precision_cuda_engine_follows_fp32(arch, precision, tiny_engine):
    with _cpu(tiny_engine, arch) as cpu_eng, _cuda(tiny_engine, arch, precision) as eng:
        assert eng.session.kv_dtype == {"fp16": "float16", "bf16": "bfloat16"}[precision]
        cpu = cpu_eng.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        gpu = eng.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        for c, g in zip(cpu, gpu):
            if c.token_ids == g.token_ids:
                continue
            j = next(i for i, (a, b) in enumerate(zip(c.token_ids, g.token_ids)) if a != b)
            ours, theirs = (cpu_eng.score(input_ids=[c.prompt_ids + t.token_ids[:j + 1]])[0].logprobs[-1]
                            for t in (c, g))
            assert ours - theirs < NEAR_TIE[precision], (
                f"{precision} {arch}: token {j} after {c.prompt_ids} is {g.token_ids[j]}, fp32 gives "
                f"{c.token_ids[j]} with a log-prob gap of {ours - theirs:.3f}")


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_cuda_batch_matches_rows_alone(precision, tiny_engine):
    """A ragged batch gives each row the tokens it gets alone (padding and per-row lengths on the device)."""
    with _cuda(tiny_engine, "llama", precision) as eng:
        batch = eng.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
        alone = [eng.generate([p], max_new_tokens=8, ignore_eos=True)[0] for p in PROMPTS]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_slot_rows_equal_each_sequence_alone(precision, tiny_engine):
    """Rows of one slot cache on the device: a ragged prefill, then decode steps of rows 0 and 2 (row 1 idle), give
    what each sequence gives in a cache of its own; a row copied on the device into another cache goes on alike."""
    with _cuda(tiny_engine, "llama", precision) as eng:
        s = eng.session
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
        rows = SlotCache(s, 3, 64)
        logits = rows.prefill_rows(0, ids)
        tokens = {r: int(logits[r].argmax()) for r in (0, 2)}
        got = rows.decode(tokens)
        copy = SlotCache(s, 1, 64)
        rows.copy_prefix(2, 0, rows.length(2), into=copy)
        for r in (0, 2):
            alone = SlotCache(s, 1, 64)
            alone.prefill(0, ids[r])
            want = alone.decode({0: tokens[r]})[0]
            np.testing.assert_allclose(got[r], want, atol=1e-3 if precision == "fp32" else 0.05)
        np.testing.assert_allclose(copy.decode({0: 7})[0], rows.decode({2: 7})[2],
                                   atol=1e-3 if precision == "fp32" else 0.05)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_cuda_score_matches_cpu(precision, tiny_engine):
    with _cpu(tiny_engine, "llama") as cpu_eng, _cuda(tiny_engine, "llama", precision) as eng:
        want = cpu_eng.score(PROMPTS)
        got = eng.score(PROMPTS)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=SCORE_ATOL[precision])


@pytest.mark.parametrize(("precision", "arch_kw"), [("fp32", {}), ("bf16", {}), ("fp32", {"disable_passes": ("attention",)})],
                         ids=["fp32-shared_buffer", "bf16-shared_buffer", "fp32-concat"])
def test_cuda_inputs_staged_in_pinned_memory(precision, arch_kw, tiny_engine):
    """A slot cache's host inputs reach the GPU from its own page-locked buffers; its decode steps reuse them where
    shapes stay; the buffers hold what the last step wrote."""
    eng_dir = tiny_engine("llama", target="cuda", precision=precision, **arch_kw)
    with trtinfer.load(eng_dir, provider="cuda") as eng:
        s = eng.session
        assert s.pinned, "this onnxruntime-gpu gave no pinned allocator"
        cache = SlotCache(s, len(PROMPTS), 64)
        logits = cache.prefill_rows(0, [eng.tokenizer.encode(p) for p in PROMPTS])
        staging = cache.staging
        assert staging is not None and staging.pinned
        made = []
        for _ in range(6):
            before = staging.allocations
            out = cache.decode({r: int(lg.argmax()) for r, lg in enumerate(logits)})
            logits = [out[r] for r in range(len(PROMPTS))]
            made.append(staging.allocations - before)
        assert "input_ids" in staging.buffers
        assert len(staging.buffers) <= len(s.input_names)
        for name, (_, value, view) in staging.buffers.items():
            assert value.data_ptr() == view.ctypes.data
            assert _cuda_memory_type(value.data_ptr()) == "host (page-locked)", name
            np.testing.assert_array_equal(value.numpy(), view)  # what the last step wrote is what the value holds
        if s.kv_layout == "shared_buffer":  # decode inputs keep their shapes: after the first step, no more buffers
            assert made[1:] == [0] * 5, made
        else:  # the attention mask grows by a column each step: one new buffer, the old one freed
            assert made[1:] == [1] * 5, made


def test_cuda_finished_generation_releases_pinned_buffers(tiny_engine):
    """Pinned buffers belong to a slot cache: none outlive it, however many generations ran."""
    with _cuda(tiny_engine, "llama") as eng:
        s = eng.session
        for _ in range(5):
            eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
            gc.collect()
            assert s.live_stagings() == []
        a, b = SlotCache(s, 3, 64), SlotCache(s, 1, 64)
        a.prefill_rows(0, [eng.tokenizer.encode(p) for p in PROMPTS])
        b.prefill(0, eng.tokenizer.encode("Hello"))
        assert len(s.live_stagings()) == 2 and a.staging is not b.staging
        del b
        gc.collect()
        assert s.live_stagings() == [a.staging]
        eng.close()
        assert a.staging.buffers == {}, "close gives live caches' buffers back"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_concurrent_generations_match_sequential(precision, tiny_engine):
    """Two threads generating at once on one CUDA session get the tokens each gets alone (no shared host buffer)."""
    jobs = {0: PROMPTS, 1: ["Once upon a time", "What is the capital of"]}
    with _cuda(tiny_engine, "llama", precision) as eng:
        assert_concurrent_equals_sequential(eng, jobs, rounds=5, max_new_tokens=12)
        gc.collect()
        assert eng.session.live_stagings() == []


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_cuda_fp32_engines_run_without_tf32(precision, tiny_engine):
    """fp32 engines ask the CUDA provider for fp32 MatMuls: its default, TF32 on Ampere and newer, failed SmolLM2's
    fp32 engine check on an H100 (0.045 on logits of 29). Reduced-precision engines keep the default."""
    with _cuda(tiny_engine, "llama", precision) as eng:
        opts = eng.session.sess.get_provider_options()["CUDAExecutionProvider"]
    assert opts["use_tf32"] == ("0" if precision == "fp32" else "1")


def _served_on_one_scheduler(eng) -> None:
    """Ragged requests joining mid-decode, a reused prefix (copied from a running row), prompt lookup and three
    seeded choices of one prompt, all on one scheduler: each answers as ``generate`` of its prompt alone."""
    from trtinfer.runtime.config import GenerationConfig
    from trtinfer.runtime.scheduler import Scheduler

    greedy = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    look = GenerationConfig(max_new_tokens=12, ignore_eos=True, prompt_lookup_num_tokens=3)
    seeded = [GenerationConfig(max_new_tokens=8, do_sample=True, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    rng = np.random.default_rng(0)
    ps = [rng.integers(3, 300, size=n).tolist() for n in (3, 17, 1, 30, 9)]
    shared = ps[3] + [7, 8]
    sched = Scheduler(eng, prefill_chunk=8, max_slots=4)
    jobs = [(ps[0], greedy), (ps[3], greedy)]
    reqs = [sched.submit(p, c) for p, c in jobs]
    for _ in range(5):
        sched.step()
    later = [(ps[1], greedy), (ps[2], greedy), (shared, greedy), (ps[4] * 3, look)] + [(ps[1], c) for c in seeded]
    reqs += [sched.submit(p, c) for p, c in later]
    jobs += later
    for _ in range(10_000):
        if not sched.step():
            break
    hits = sched.stats()["prefix_cache_hits"]
    sched.close()
    assert hits >= 30, hits
    for req, (p, c) in zip(reqs, jobs):
        got, want = req.result(), eng.generate(input_ids=[p], config=c)[0]
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (p, c)


@pytest.mark.parametrize(("arch", "precision", "layout"), [("llama", "fp32", "concat"), ("gemma3", "fp32", "concat"),
                                                       ("llama", "fp16", "shared_buffer")])
def test_cuda_engine_is_served_by_the_scheduler(arch, precision, layout, tiny_engine):
    """The one loop on CUDA, prefix caching on: fp32 engines keep attention unfused (concat: rows gathered from host
    slots each pass), fp16 ones run GroupQueryAttention over slot rows bound by device address. fp32 greedy rows
    also equal the CPU engine's."""
    with _cuda(tiny_engine, arch, precision) as eng:
        assert eng.session.kv_layout == layout and eng.session.device == "cuda"
        _served_on_one_scheduler(eng)
        gpu = eng.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    if precision == "fp32":
        with _cpu(tiny_engine, arch) as cpu_eng:
            cpu = cpu_eng.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]


def _tensorrt(engine_dir, cache_dir):
    """A session on ONNX Runtime's TensorRT provider, or a skip saying what this machine lacks."""
    import onnxruntime as ort

    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no TensorrtExecutionProvider")
    try:
        return trtinfer.load(engine_dir, provider="tensorrt", trt_cache_dir=str(cache_dir))
    except trtinfer.errors.BackendUnavailableError as e:  # TensorRT's libraries not installed or not found
        pytest.skip(str(e))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_provider_follows_cpu_and_caches_engines(precision, tiny_engine, tmp_path):
    """The TensorRT provider generates what the fp32 CPU engine does (up to near ties) and leaves its engines in the
    cache folder, which a second load reuses."""
    eng_dir = tiny_engine("llama", target="cuda", precision=precision)
    with _cpu(tiny_engine, "llama") as cpu_eng, _tensorrt(eng_dir, tmp_path / "trt") as eng:
        assert eng.session.device == "cuda"
        assert eng.session.sess.get_providers()[:2] == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
        gpu = eng.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
        cpu = cpu_eng.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
        for c, g in zip(cpu, gpu):
            if c.token_ids == g.token_ids:
                continue
            j = next(i for i, (a, b) in enumerate(zip(c.token_ids, g.token_ids)) if a != b)
            ours, theirs = (cpu_eng.score(input_ids=[c.prompt_ids + t.token_ids[:j + 1]])[0].logprobs[-1]
                            for t in (c, g))
            assert ours - theirs < NEAR_TIE["fp16"], (precision, j, ours - theirs)
    engines = sorted(p.name for p in (tmp_path / "trt").iterdir())
    assert any(n.endswith(".engine") for n in engines), engines
    with _tensorrt(eng_dir, tmp_path / "trt") as again:
        assert [r.token_ids for r in again.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)] == [
            r.token_ids for r in gpu]


def _cuda_memory_type(ptr: int) -> str:
    """What CUDA says ``ptr`` points to (``cudaPointerGetAttributes``), through the CUDA runtime ONNX Runtime loaded."""
    import ctypes

    import onnxruntime as ort

    major = (getattr(ort, "cuda_version", "") or "13").split(".")[0]  # the CUDA onnxruntime-gpu was built for
    try:
        cudart = ctypes.CDLL(f"libcudart.so.{major}")
    except OSError as e:
        pytest.skip(f"libcudart.so.{major} not loadable here: {e}")
    # cudaPointerAttributes starts with int type; the rest (device, pointers, reserved words) fits well in 512 bytes
    attrs = (ctypes.c_int * 128)()
    rc = cudart.cudaPointerGetAttributes(attrs, ctypes.c_void_p(ptr))
    assert rc == 0, f"cudaPointerGetAttributes returned {rc}"
    return {0: "unregistered (pageable)", 1: "host (page-locked)", 2: "device", 3: "managed"}.get(attrs[0], str(attrs[0]))


def test_cuda_runtime_without_torch(tiny_engine):
    """The CUDA path loads and runs with onnxruntime-gpu + numpy + tokenizers: torch and transformers unimportable."""
    eng = tiny_engine("llama", target="cuda", precision="fp16")
    with trtinfer.load(eng, provider="cuda") as e:
        want = e.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)
    code = textwrap.dedent(f"""
        import sys
        for name in ("torch", "transformers", "onnx"):
            sys.modules[name] = None  # any import of them now fails
        import trtinfer
        with trtinfer.load({str(eng)!r}, provider="cuda") as e:
            assert e.session.pinned
            r = e.generate({PROMPTS!r}, max_new_tokens=6, ignore_eos=True)
        assert not any(m.startswith(("torch", "transformers")) and sys.modules[m] is not None for m in sys.modules)
        print([x.token_ids for x in r])
    """)
    path = os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": path})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str([r.token_ids for r in want])
