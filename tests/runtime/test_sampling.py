"""Sampling primitives on hand-made logits."""
from __future__ import annotations

import numpy as np

from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.sampling import apply_repetition_penalty, select_next, top_k_top_p_filter


def test_top_k_keeps_k_largest():
    x = np.array([[1.0, 5.0, 3.0, 4.0, 2.0]], np.float32)
    out = top_k_top_p_filter(x, 2, 1.0)
    assert np.isfinite(out).sum() == 2 and set(np.flatnonzero(np.isfinite(out[0]))) == {1, 3}


def test_top_p_keeps_smallest_nucleus():
    p = np.array([[0.5, 0.3, 0.15, 0.05]])
    out = top_k_top_p_filter(np.log(p), 0, 0.7)  # 0.5 + 0.3 reach 0.7
    assert list(np.isfinite(out[0])) == [True, True, False, False]
    out = top_k_top_p_filter(np.log(p), 0, 0.4)  # the first token always stays
    assert list(np.isfinite(out[0])) == [True, False, False, False]


def test_repetition_penalty_signs():
    x = np.array([[2.0, -2.0, 1.0]], np.float32)
    apply_repetition_penalty(x, [np.array([0, 1, 1])], 2.0)
    assert x.tolist() == [[1.0, -4.0, 1.0]]


def test_min_new_tokens_blocks_eos():
    x = np.array([[0.0, 10.0, 1.0]], np.float32)
    cfg = GenerationConfig(min_new_tokens=2, max_new_tokens=4)
    assert select_next(x, cfg, [np.array([], np.int64)], 0, [1], []).tolist() == [2]
    assert select_next(x, cfg, [np.array([], np.int64)], 2, [1], []).tolist() == [1]


def test_sampling_distribution_follows_temperature():
    x = np.log(np.array([[0.7, 0.2, 0.1]], np.float32))
    cfg = GenerationConfig(do_sample=True)
    rng = [np.random.default_rng(0)]
    draws = [select_next(x, cfg, [np.array([], np.int64)], 0, [], rng)[0] for _ in range(3000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, [0.7, 0.2, 0.1], atol=0.03)
