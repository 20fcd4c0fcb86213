"""Contexts and the Forward builder on tiny engines: probes equal PyTorch eager, fork and truncate are exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import trtinfer
from trtinfer import Argmax, Distribution, Entropy, Logits, Logprob, Logprobs, Sampler
from trtinfer.errors import InputError

IDS = [5, 17, 42, 99, 7, 3, 250, 11, 60, 8, 9, 10]


def eager_logits(src, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].double().numpy()  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=["shared", "concat"])
def engine(request, tiny_engine):
    kw = {} if request.param == "shared" else {"disable_passes": ("attention",)}
    with trtinfer.load(tiny_engine("llama", **kw)) as eng:
        assert eng.manifest.raw["kv_layout"] == ("shared_buffer" if request.param == "shared" else "concat")
        yield eng


def test_probes_equal_eager(engine, tiny_model_dir):
    ref = eager_logits(tiny_model_dir("llama"), IDS)
    lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    ctx = engine.context(capacity=32)
    fwd = ctx.forward().input(IDS[:7])
    h_logits = fwd.probe(3, Logits())
    h_lp = fwd.probe(-1, Logprob(IDS[7]))
    h_lps = fwd.probe(-1, Logprobs([1, 2, IDS[7]]))
    h_ent = fwd.probe(0, Entropy())
    h_dist = fwd.probe(-1, Distribution(k=5))
    h_tok = fwd.sample([-1], Argmax())[0]
    out = fwd.execute()
    np.testing.assert_allclose(out.logits(h_logits), ref[3], rtol=1e-4, atol=1e-4)
    assert out.logprobs(h_lp) == pytest.approx(lp[6, IDS[7]], abs=1e-4)
    np.testing.assert_allclose(out.logprobs(h_lps), lp[6, [1, 2, IDS[7]]], atol=1e-4)
    p0 = np.exp(lp[0])
    assert out.entropy(h_ent) == pytest.approx(-(p0 * lp[0]).sum(), abs=1e-4)
    ids, probs = out.distribution(h_dist)
    assert ids.tolist() == np.argsort(-ref[6], kind="stable")[:5].tolist()
    np.testing.assert_allclose(probs, np.exp(lp[6, ids]), atol=1e-5)
    assert out.token(h_tok) == int(ref[6].argmax())
    # a second pass continues the sequence: its position 0 is the 8th token
    f2 = ctx.forward().input(IDS[7:])
    h2 = f2.probe(0, Logits())
    np.testing.assert_allclose(f2.execute().logits(h2), ref[7], rtol=1e-4, atol=1e-4)
    assert len(ctx) == len(IDS)


def test_fork_and_truncate_are_exact(engine):
    ctx = engine.context(capacity=32)
    ctx.forward().input(IDS[:6]).execute()
    fork = ctx.fork()

    def next_logits(c, toks):
        f = c.forward().input(toks)
        h = f.probe(-1, Logits())
        return f.execute().logits(h)

    a = next_logits(ctx, IDS[6:9])
    b = next_logits(fork, IDS[6:9])  # the fork continued = the original continued
    np.testing.assert_allclose(a, b, atol=1e-6)
    c = next_logits(fork, [1, 2])  # the fork diverges; the original is untouched
    fresh = engine.context(capacity=32)
    np.testing.assert_allclose(c, next_logits(fresh, IDS[:9] + [1, 2]), atol=1e-5)
    ctx.truncate(4)  # drop 5 tokens (rejected drafts), feed others: = never having fed them
    d = next_logits(ctx, [77, 78])
    np.testing.assert_allclose(d, next_logits(engine.context(capacity=32), IDS[:4] + [77, 78]), atol=1e-5)


def test_greedy_through_passes_equals_generate(engine):
    want = engine.generate(input_ids=[IDS[:5]], max_new_tokens=6, ignore_eos=True)[0].token_ids
    ctx, got, feed = engine.context(capacity=32), [], IDS[:5]
    for _ in range(6):
        f = ctx.forward().input(feed)
        h = f.sample(-1, Argmax())[0]
        feed = [f.execute().token(h)]
        got.append(feed[0])
    assert got == want
    s = engine.context(capacity=32).forward().input(IDS[:5])
    h1 = s.sample(-1, Sampler(temperature=0.7, top_k=20, seed=3))[0]
    tok = s.execute().token(h1)
    s2 = engine.context(capacity=32).forward().input(IDS[:5])
    h2 = s2.sample(-1, Sampler(temperature=0.7, top_k=20, seed=3))[0]
    assert s2.execute().token(h2) == tok  # seeded


def test_misuse_is_one_clear_error(engine):
    ctx = engine.context(capacity=8)
    f = ctx.forward().input([1, 2, 3])
    h = f.probe(-1, Entropy())
    out = f.execute()
    with pytest.raises(InputError, match=r"entropy handle; read it with out.entropy\(h\), not out.token\(h\)"):
        out.token(h)
    with pytest.raises(InputError, match="already ran"):
        f.execute()
    with pytest.raises(InputError, match="position 5 is outside this pass's 1 input tokens"):
        ctx.forward().input([4]).probe(5, Logits())
    with pytest.raises(InputError, match="next positions only"):
        ctx.forward().input_at([4], [7])
    with pytest.raises(InputError, match="custom attention masks are not supported"):
        ctx.forward().attention_mask(np.ones((1, 4)))
    with pytest.raises(InputError, match="do not fit"):
        ctx.forward().input([1] * 6).execute()
    with pytest.raises(InputError, match="outside the vocabulary"):
        ctx.forward().input([10**6])
    with pytest.raises(InputError, match="probe\\(\\) takes"):
        ctx.forward().input([1]).probe(0, Argmax())


def test_contexts_of_one_batch_run_as_one_step(engine):
    """engine.contexts(n): ragged prefills and one-token decodes of several contexts run as one batched pass each and
    give what each context gives alone; a released context leaves the batch; other passes run one by one, each on its
    own row."""
    prompts = [IDS[:5], IDS[:9], IDS[2:5]]
    calls: list[tuple[str, int]] = []  # (what, rows) of each pass the session runs
    session = engine.session
    real = {n: getattr(session, n) for n in ("run_rows", "run_bound")}

    def counted(name):
        def run(feeds, *a, **k):
            calls.append((name, feeds["input_ids"].shape[0]))
            return real[name](feeds, *a, **k)
        return run

    for n in real:
        setattr(session, n, counted(n))
    try:
        ctxs = engine.contexts(3, capacity=32)
        passes = [c.forward().input(p) for c, p in zip(ctxs, prompts)]
        hs = [f.sample(-1, Argmax())[0] for f in passes]
        outs = engine.execute(passes)
        assert [rows for _, rows in calls] == [3]  # one pass for the three ragged prompts
        toks = [o.token(h) for o, h in zip(outs, hs)]
        seqs = [p + [t] for p, t in zip(prompts, toks)]
        for step in range(3):
            calls.clear()
            passes = [c.forward().input([s[-1]]) for c, s in zip(ctxs, seqs)]
            hl = [f.probe(-1, Logits()) for f in passes]
            outs = engine.execute(passes)
            assert len(calls) == 1  # one batched decode step
            for s, o, h in zip(seqs, outs, hl):
                s.append(int(o.logits(h).argmax()))
            if step == 0:
                ctxs[1].release()  # its row leaves the batch; the others go on
                ctxs, seqs = [ctxs[0], ctxs[2]], [seqs[0], seqs[2]]
        calls.clear()
        f0 = ctxs[0].forward().input([seqs[0][-1], 5])  # two tokens: not a decode step, so one by one
        f1 = ctxs[1].forward().input([seqs[1][-1]])
        engine.execute([f0, f1])
        assert [rows for _, rows in calls] == [1, 1]
        # a row of a batch truncates and continues like a fresh context
        keep = prompts[0] + seqs[0][len(prompts[0]):len(prompts[0]) + 2]
        ctxs[0].truncate(len(keep))
        f = ctxs[0].forward().input([7, 8])
        h = f.probe(-1, Logits())
        fresh = engine.context(capacity=32).forward().input(keep + [7, 8])
        hf = fresh.probe(-1, Logits())
        np.testing.assert_allclose(f.execute().logits(h), fresh.execute().logits(hf), atol=1e-5)
    finally:
        for n in real:
            delattr(session, n)
    for p, s in zip([prompts[0], prompts[2]], seqs):  # each equals greedy generation of its prompt alone
        assert s[len(p):] == engine.generate(input_ids=[p], max_new_tokens=4, ignore_eos=True)[0].token_ids
    with pytest.raises(InputError, match="one pass per context"):
        c = engine.contexts(1)[0]
        engine.execute([c.forward().input([1]), c.forward().input([2])])
    with pytest.raises(InputError, match="contexts\\(n\\): n must be within"):
        engine.contexts(0)
    small = engine.contexts(2, capacity=4)
    with pytest.raises(InputError, match="a prompt of 10 tokens does not fit the contexts' capacity of 4"):
        engine.execute([c.forward().input(IDS[:10]) for c in small])
