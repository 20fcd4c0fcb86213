"""Next-token selection: processors and warpers against transformers' own, the draw against the probabilities,
rows independent of their batch neighbours."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from trtinfer.errors import ConfigError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.sampling import (
    CANDIDATES,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    banned_ngram_tokens,
    filter_logits,
    sample,
    select_next,
)

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")

NONE = np.array([], np.int64)


class FixedDraw:
    """A stand-in for a row's generator whose ``random()`` returns ``u``."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


def hf_filter(x: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """transformers' warpers in its order (top-k -> top-p -> min-p), min_tokens_to_keep=1."""
    t = torch.from_numpy(np.array(x, np.float32))
    if top_k:
        t = lp.TopKLogitsWarper(top_k)(None, t)
    if top_p < 1.0:
        t = lp.TopPLogitsWarper(top_p)(None, t)
    if min_p:
        t = lp.MinPLogitsWarper(min_p)(None, t)
    return t.numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def top_p_margin(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Per row, how close (in float64) the probability above some token comes to ``top_p``: below ~1e-5,
    transformers' float32 softmax and cumulative sum over the whole vocabulary (their total is off by ~3e-6 at
    49,152 tokens) may keep one token more or less than the exact rule."""
    if top_p >= 1.0:
        return np.full(len(x), np.inf)
    x = hf_filter(x, top_k).astype(np.float64)
    p = np.sort(softmax(x), axis=-1)[:, ::-1]
    above = np.cumsum(p, axis=-1) - p
    return np.abs(above - top_p).min(axis=-1)  # type: ignore[no-any-return]


def assert_same_kept(ours: np.ndarray, ref: np.ndarray, x: np.ndarray, top_k: int = 0, top_p: float = 1.0) -> None:
    """Same kept tokens per row; within the tie group at the boundary (the smallest kept logit) only the count must
    agree: transformers' torch.sort does not order ties stably, so which of them it keeps is unspecified. A row whose
    top-p boundary is a float32 rounding tie (:func:`top_p_margin`) may differ by that one token."""
    a, b = np.isfinite(ours), np.isfinite(ref)
    rounding_tie = top_p_margin(x, top_k, top_p) < 1e-5
    assert ((a.sum(-1) == b.sum(-1)) | (rounding_tie & (np.abs(a.sum(-1) - b.sum(-1)) == 1))).all(), \
        (a.sum(-1), b.sum(-1))
    for r in range(len(x)):
        boundary = min(x[r][b[r]].min(), x[r][a[r]].min())
        off = x[r] > boundary
        assert (a[r][off] == b[r][off]).all(), r


def lm_like(rng: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    """Logits with a language model's shape: a broad background and a few much larger ones."""
    x = rng.standard_normal((batch, vocab)) * 2.0
    for r in range(batch):
        x[r, rng.choice(vocab, 8, replace=False)] += rng.uniform(4, 12, 8)
    return x.astype(np.float32)


# --- warpers against transformers ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [
    (50, 1.0, 0.0), (1, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0), (0, 0.999, 0.0), (0, 1.0, 0.05), (0, 1.0, 1.0),
    (40, 0.9, 0.0), (0, 0.9, 0.1), (40, 0.95, 0.02), (3000, 0.8, 0.0),
])
@pytest.mark.parametrize("vocab", [17, 1000, 49152])
def test_warpers_match_transformers(top_k, top_p, min_p, vocab):
    rng = np.random.default_rng(vocab + top_k)
    x = np.concatenate([lm_like(rng, 3, vocab), (rng.standard_normal((3, vocab)) * 3).astype(np.float32)])
    np.testing.assert_array_equal(filter_logits(x, top_k, top_p, min_p), hf_filter(x, top_k, top_p, min_p))


@pytest.mark.parametrize(("top_k", "top_p"), [(50, 1.0), (40, 0.9), (200, 0.95), (256, 1.0)])
def test_top_k_near_the_max_matches_transformers(top_k, top_p):
    """Rows with hundreds of tokens within 8 of their max (top-k then selects among those alone), rows with too few
    (the whole row), and rows with ties at the k-th: the kept sets are transformers'."""
    rng = np.random.default_rng(top_k)
    vocab = 49152
    x = (rng.standard_normal((6, vocab)) - 12).astype(np.float32)
    for r, n in enumerate([300, 60, 20, 1000, 300, 0]):
        x[r, rng.choice(vocab, n, replace=False)] = rng.uniform(0, 8, n).astype(np.float32)
    x[4, rng.choice(vocab, 80, replace=False)] = 5.0  # a tie spanning the k-th largest
    ours, ref = filter_logits(x, top_k, top_p), hf_filter(x, top_k, top_p)
    np.testing.assert_array_equal(ours[:4], ref[:4])
    assert_same_kept(ours[4:], ref[4:], x[4:], top_k, top_p)  # which tied tokens top-p keeps is torch's sort's whim


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_temperature_then_warpers_match_transformers(temperature):
    rng = np.random.default_rng(1)
    x = lm_like(rng, 4, 500)
    t = lp.TemperatureLogitsWarper(temperature)(None, torch.from_numpy(x.copy())).numpy()
    cfg = GenerationConfig(do_sample=True, temperature=temperature)
    np.testing.assert_array_equal(x / np.float32(cfg.temperature), t)
    ours = filter_logits(x / np.float32(temperature), 20, 0.9, 0.05)
    np.testing.assert_array_equal(ours, hf_filter(t, 20, 0.9, 0.05))


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 0.9, 0.3), (4, 0.6, 0.1),
                                                      (0, 0.4, 0.0), (2, 1.0, 0.0)])
def test_ties_match_transformers_in_count(top_k, top_p, min_p):
    rng = np.random.default_rng(top_k + int(top_p * 10))
    for vocab in (12, 300, 49152):
        x = rng.integers(-3, 4, (6, vocab)).astype(np.float32)  # many equal logits, also at every boundary
        ours, ref = filter_logits(x, top_k, top_p, min_p), hf_filter(x, top_k, top_p, min_p)
        assert_same_kept(ours, ref, x, top_k, top_p)


def test_top_k_keeps_every_tie_with_the_kth():
    x = np.array([[1.0, 5.0, 3.0, 3.0, 2.0, 3.0]], np.float32)
    assert np.flatnonzero(np.isfinite(filter_logits(x, top_k=2)[0])).tolist() == [1, 2, 3, 5]
    assert np.flatnonzero(np.isfinite(filter_logits(x, top_k=1)[0])).tolist() == [1]


def test_top_p_boundary_is_transformers_rule():
    p = np.array([[0.5, 0.3, 0.15, 0.05]])
    assert np.isfinite(filter_logits(np.log(p), top_p=0.7)[0]).tolist() == [True, True, False, False]
    assert np.isfinite(filter_logits(np.log(p), top_p=0.4)[0]).tolist() == [True, False, False, False]  # first stays
    # four equal tokens (probabilities exact in binary): a token stays while the mass above it is < top_p
    x = np.zeros((1, 4), np.float32)
    for top_p, kept in [(0.25, 1), (0.26, 2), (0.5, 2), (0.6, 3), (0.75, 3), (0.76, 4)]:
        ours = filter_logits(x, top_p=top_p)
        assert np.isfinite(ours).sum() == np.isfinite(hf_filter(x, top_p=top_p)).sum() == kept, top_p
        # among equal logits the larger ids stay (a stable ascending sort read from the top)
        assert np.flatnonzero(np.isfinite(ours[0])).tolist() == list(range(4 - kept, 4))


def test_top_p_past_the_candidate_set():
    """Nuclei larger than the candidate set, and a tie group cut by its edge."""
    rng = np.random.default_rng(3)
    vocab = 49152
    flat = (rng.standard_normal((2, vocab)) * 0.5).astype(np.float32)  # nucleus of tens of thousands of tokens
    ties = np.full((1, vocab), -20.0, np.float32)
    ties[0, :10] = 2.0
    ties[0, 100:100 + 2 * CANDIDATES] = 0.0  # equal logits straddling the set's edge
    x = np.concatenate([flat, ties, lm_like(rng, 1, vocab)])
    for top_p in (0.5, 0.9, 0.97):
        ours, ref = filter_logits(x, top_p=top_p), hf_filter(x, top_p=top_p)
        assert np.isfinite(ours[0]).sum() > 4 * CANDIDATES
        assert 10 < np.isfinite(ours[2]).sum() < 10 + 2 * CANDIDATES
        assert_same_kept(ours, ref, x, 0, top_p)


# --- processors against transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 100)) * 3).astype(np.float32)
    seen = rng.integers(0, 100, (3, 40))
    ref = lp.RepetitionPenaltyLogitsProcessor(penalty)(torch.from_numpy(seen), torch.from_numpy(x.copy())).numpy()
    ours = x.copy()
    apply_repetition_penalty(ours, list(seen), penalty)
    np.testing.assert_array_equal(ours, ref)


def test_repetition_penalty_signs():
    x = np.array([[2.0, -2.0, 1.0]], np.float32)
    apply_repetition_penalty(x, [np.array([0, 1, 1])], 2.0)
    assert x.tolist() == [[1.0, -4.0, 1.0]]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_transformers(n):
    rng = np.random.default_rng(n)
    for length in (n - 1, n, 30):
        seqs = rng.integers(0, 6, (4, length))  # few distinct ids: many repeated n-grams
        x = (rng.standard_normal((4, 10))).astype(np.float32)
        ref = lp.NoRepeatNGramLogitsProcessor(n)(torch.from_numpy(seqs), torch.from_numpy(x.copy())).numpy()
        cfg = GenerationConfig(no_repeat_ngram_size=n, do_sample=True)
        ours = x.copy()
        for r in range(4):
            ours[r, banned_ngram_tokens(seqs[r], n)] = -np.inf
        np.testing.assert_array_equal(ours, ref)
        # select_next applies the same ban: a banned token is never drawn
        for r in range(4):
            drawn = {int(select_next(x[r:r + 1], cfg, [seqs[r]], 0, [], [FixedDraw(u)])[0])
                     for u in np.linspace(0, 0.999, 200)}
            assert not drawn & set(banned_ngram_tokens(seqs[r], n).tolist())


def test_presence_frequency_penalties_follow_openai():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 20)) * 2).astype(np.float32)
    generated = [np.array([3, 3, 5, 3, 19]), np.array([], np.int64)]
    ours = x.copy()
    apply_presence_frequency_penalties(ours, generated, 0.5, -0.25)
    want = x.copy()
    counts = np.bincount(generated[0], minlength=20)
    want[0] -= (0.5 * (counts > 0) + -0.25 * counts).astype(np.float32)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-6)
    assert ours[0, 3] == pytest.approx(x[0, 3] - 0.5 + 0.75, abs=1e-6)


def test_presence_frequency_count_generated_tokens_only():
    x = np.zeros((1, 6), np.float32)
    x[0, 1] = 1.0  # the prompt's token 1 is the greedy pick; generating 2 twice must not push 1 down
    cfg = GenerationConfig(presence_penalty=2.0, frequency_penalty=1.0)
    seen = [np.array([1, 1, 1, 2, 2])]  # prompt [1, 1, 1], generated [2, 2]
    assert select_next(x, cfg, seen, 2, [], []).tolist() == [1]
    # counted over the last n_generated tokens of seen: the third 1 counted as generated pushes 1 below 0
    assert select_next(x, cfg, seen, 3, [], []).tolist() == [0]


def test_min_new_tokens_blocks_eos():
    x = np.array([[0.0, 10.0, 1.0]], np.float32)
    cfg = GenerationConfig(min_new_tokens=2, max_new_tokens=4)
    assert select_next(x, cfg, [NONE], 0, [1], []).tolist() == [2]
    assert select_next(x, cfg, [NONE], 2, [1], []).tolist() == [1]


def test_processor_order_matches_transformers():
    """repetition -> no-repeat n-gram -> min_new_tokens -> temperature -> top-k -> top-p -> min-p: each token is drawn
    as often as transformers' probability over a fine grid of uniforms (an inverse CDF, in any order)."""
    rng = np.random.default_rng(5)
    vocab, n_grid = 40, 4000
    x = lm_like(rng, 1, vocab)
    x[0, 7] = x.max() + 1  # an EOS that would be drawn most often, were it not blocked
    seq = rng.integers(0, vocab, (1, 25))
    procs = lp.LogitsProcessorList([
        lp.RepetitionPenaltyLogitsProcessor(1.4), lp.NoRepeatNGramLogitsProcessor(2),
        lp.MinNewTokensLengthLogitsProcessor(24, 3, [7, 9]), lp.TemperatureLogitsWarper(0.8),
        lp.TopKLogitsWarper(12), lp.TopPLogitsWarper(0.95), lp.MinPLogitsWarper(0.02),
    ])
    probs = softmax(procs(torch.from_numpy(seq), torch.from_numpy(x.copy())).numpy())[0]
    cfg = GenerationConfig(do_sample=True, repetition_penalty=1.4, no_repeat_ngram_size=2, min_new_tokens=3,
                           temperature=0.8, top_k=12, top_p=0.95, min_p=0.02)
    us = (np.arange(n_grid) + 0.5) / n_grid
    tokens = [int(select_next(x, cfg, [seq[0]], 1, [7, 9], [FixedDraw(u)])[0]) for u in us]
    counts = np.bincount(tokens, minlength=vocab)
    assert np.abs(counts - probs * n_grid).max() <= 1.01  # an inverse CDF on a grid is off by at most one draw
    assert set(np.flatnonzero(counts)) == set(np.flatnonzero(probs * n_grid >= 1))


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(0, 1.0, 0.0), (0, 1.0, 0.1), (8, 1.0, 0.0), (0, 0.8, 0.0),
                                                      (8, 0.9, 0.05)])
def test_draw_is_an_inverse_cdf_of_the_kept_probabilities(top_k, top_p, min_p):
    rng = np.random.default_rng(top_k)
    # 700: the whole-vocabulary draw spans several blocks; 5000 flat: top-p past the candidate set
    for vocab, x in [(30, lm_like(rng, 1, 30) / 3), (700, lm_like(rng, 1, 700) / 3),
                     (5000, rng.standard_normal((1, 5000)).astype(np.float32) * 0.3)]:
        probs = softmax(hf_filter(x, top_k, top_p, min_p))[0]
        if vocab == 5000 and top_p < 1.0 and not top_k:
            assert (probs > 0).sum() > CANDIDATES
        n_grid = 5000 if vocab < 5000 else 1000
        u = (np.arange(n_grid) + 0.5) / n_grid
        counts = np.bincount(sample(np.repeat(x, n_grid, axis=0), u, top_k, top_p, min_p), minlength=vocab)
        assert np.abs(counts - probs * n_grid).max() <= 1.01


def test_sampled_frequencies_follow_probabilities():
    """Chi-square of 20,000 seeded draws (1,000 rows with their own seeds, 20 steps) against transformers'
    probabilities (df = kept tokens - 1)."""
    x = np.log(np.array([[0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.04, 0.02, 0.01]], np.float32))
    cfg = GenerationConfig(do_sample=True, temperature=0.9, top_k=7, top_p=0.95)
    probs = softmax(hf_filter(x / np.float32(0.9), 7, 0.95))[0]
    rows = 1000
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(0).spawn(rows)]
    batch = np.repeat(x, rows, axis=0)
    draws = np.concatenate([select_next(batch, cfg, [NONE] * rows, step, [], rngs) for step in range(20)])
    counts = np.bincount(draws, minlength=x.shape[1])
    kept = probs > 0
    assert kept.sum() == 6 and counts[~kept].sum() == 0
    expected = probs[kept] * len(draws)
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    assert chi2 < 20.5  # df 5: P(chi2 > 20.5) ~ 0.001


def test_sampling_distribution_follows_temperature():
    x = np.log(np.array([[0.7, 0.2, 0.1]], np.float32))
    cfg = GenerationConfig(do_sample=True)
    rng = [np.random.default_rng(0)]
    draws = [select_next(x, cfg, [NONE], 0, [], rng)[0] for _ in range(3000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, [0.7, 0.2, 0.1], atol=0.03)


# --- reproducibility ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [
    GenerationConfig(do_sample=True), GenerationConfig(do_sample=True, top_p=0.9),
    GenerationConfig(do_sample=True, top_k=50), GenerationConfig(do_sample=True, top_k=50, top_p=0.9, min_p=0.05),
    GenerationConfig(do_sample=True, temperature=0.7, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5),
])
def test_rows_do_not_depend_on_their_batch_neighbours(cfg):
    """Row r with seed s draws the same tokens alone and in any batch (a flat row that takes the widest candidate
    set among them), and the same tokens run to run."""
    rng = np.random.default_rng(11)
    vocab = 49152
    rows = np.concatenate([lm_like(rng, 5, vocab), (rng.standard_normal((1, vocab)) * 0.5).astype(np.float32)])
    seen = [rng.integers(0, vocab, 30) for _ in range(6)]

    def run(order: list[int], steps: int = 6) -> dict[int, list[int]]:
        rngs = [np.random.default_rng(1000 + i) for i in order]
        out: dict[int, list[int]] = {i: [] for i in order}
        for step in range(steps):
            toks = select_next(rows[order], cfg, [seen[i] for i in order], step, [], rngs)
            for i, t in zip(order, toks):
                out[i].append(int(t))
        return out

    batched = run([0, 1, 2, 3, 4, 5])
    assert batched == run([5, 3, 1, 0, 2, 4]) == run([0, 1, 2, 3, 4, 5])
    for i in range(6):
        assert run([i])[i] == batched[i]


def test_greedy_is_the_argmax():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 1000))).astype(np.float32)
    assert select_next(x, GenerationConfig(), [NONE] * 4, 0, [], []).tolist() == x.argmax(-1).tolist()
    assert select_next(x.astype(np.float16), GenerationConfig(), [NONE] * 4, 0, [], []).dtype == np.int64


# --- configuration ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "message"), [
    ({"min_p": 1.5}, "min_p must be within [0, 1] (0 disables it), got 1.5"),
    ({"min_p": -0.1}, "min_p must be within [0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty must be within [-2, 2] (0 disables it), got 2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty must be within [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be >= 0 (0 disables it), got -1"),
    ({"no_repeat_ngram_size": 2.0}, "no_repeat_ngram_size must be an integer, got 2.0"),
    ({"min_p": "0.1"}, "min_p must be a finite number"),
])
def test_new_fields_are_validated(kw, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
        GenerationConfig(**kw)
    assert e.value.field == next(iter(kw))


def test_cli_flags_reach_the_config_and_errors_name_the_flag():
    from trtinfer.cli import generate

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-m", "trtinfer", "generate", "no-such-engine", "-p", "hi", "--min-p", "2"],
                       capture_output=True, text=True, env=env, check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "--min-p must be within [0, 1]" in p.stderr, p.stderr
    parser = __import__("argparse").ArgumentParser()
    generate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", "e", "-p", "x", "--min-p", "0.1", "--presence-penalty", "0.5",
                              "--frequency-penalty", "-0.5", "--no-repeat-ngram-size", "3"])
    assert (args.min_p, args.presence_penalty, args.frequency_penalty, args.no_repeat_ngram_size) == (0.1, 0.5, -0.5, 3)
