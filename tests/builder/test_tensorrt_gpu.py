"""TensorRT engines on a GPU: tiny engines give the ONNX Runtime CPU engine's greedy tokens and scores.

These run only where TensorRT >= 10.15, cuda-python and a GPU exist; elsewhere they skip with the reason
``require_tensorrt`` gives (on this project's machines: TensorRT cannot be installed, so they have never run).
"""
from __future__ import annotations

import numpy as np
import pytest

import trtinfer
from trtinfer.errors import BackendUnavailableError

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 60], [8, 9, 10], [200, 201]]


def _require() -> None:
    from trtinfer.builder.trt_backend import require_tensorrt

    try:
        require_tensorrt()
    except BackendUnavailableError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engines(request, tiny_engine):
    _require()
    arch = request.param
    return (tiny_engine(arch, backend="tensorrt", max_seq_len=64, max_batch_size=4),
            tiny_engine(arch, backend="tensorrt", max_seq_len=64, max_batch_size=4, precision="fp16"),
            tiny_engine(arch))


def test_fp32_engine_greedy_equals_cpu(engines):
    trt32, _, cpu = engines
    with trtinfer.load(trt32) as eng, trtinfer.load(cpu) as ref:
        assert eng.manifest.raw["tensorrt"]["profiles"][0]["name"] == "prefill"
        got = eng.generate(input_ids=PROMPTS, max_new_tokens=10, ignore_eos=True)
        want = ref.generate(input_ids=PROMPTS, max_new_tokens=10, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_fp32_engine_scores_equal_cpu(engines):
    trt32, _, cpu = engines
    ids = list(range(3, 40))
    with trtinfer.load(trt32) as eng, trtinfer.load(cpu) as ref:
        np.testing.assert_allclose(eng.score(input_ids=[ids])[0].logprobs, ref.score(input_ids=[ids])[0].logprobs,
                                   atol=2e-3)


def test_fp16_engine_and_cuda_graphs(engines):
    _, trt16, cpu = engines
    with trtinfer.load(trt16, cuda_graphs=True) as eng, trtinfer.load(cpu) as ref:
        got = eng.generate(input_ids=PROMPTS, max_new_tokens=10, ignore_eos=True)
        want = ref.generate(input_ids=PROMPTS, max_new_tokens=10, ignore_eos=True)
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g.token_ids, w.token_ids))
        assert same >= 0.8 * 30  # fp16 may part at near-ties; most tokens agree


def test_engine_from_another_gpu_is_refused(engines, tmp_path):
    import json
    import shutil

    trt32 = engines[0]
    copy = tmp_path / "eng"
    shutil.copytree(trt32, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["tensorrt"]["compute_capability"] = "1.0"
    (copy / "manifest.json").write_text(json.dumps(m))
    from trtinfer.errors import EngineLoadError

    with pytest.raises(EngineLoadError, match="rebuild it here"):
        trtinfer.load(copy)
