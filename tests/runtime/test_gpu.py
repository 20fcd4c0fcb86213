"""CUDA execution provider: same greedy tokens as the CPU engine. Runs only where onnxruntime-gpu sees a GPU."""
from __future__ import annotations

import pytest

import trtinfer

pytestmark = pytest.mark.gpu

PROMPTS = ["The history of the city", "Hello", "A quick brown fox jumps over the lazy dog while the cat"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_engine_matches_cpu(arch, tiny_engine):
    cpu = trtinfer.load(tiny_engine(arch)).generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    with trtinfer.load(tiny_engine(arch, target="cuda"), provider="cuda") as eng:
        gpu = eng.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        assert eng.session.device == "cuda"
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]
