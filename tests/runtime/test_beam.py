"""Beam search equals transformers' ``generate(num_beams=...)`` on tiny random models: tokens and sequence scores."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import trtinfer
from trtinfer.errors import ConfigError, InputError

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [60, 8, 9, 10, 12, 13, 1]]


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["shared", "concat"])
def engine(request, tiny_engine):
    kw = {} if request.param == "shared" else {"disable_passes": ("attention",)}
    with trtinfer.load(tiny_engine("llama", **kw)) as eng:
        yield eng


_HF: dict = {}


def hf_beams(model, prompt, n, eos, **kw):
    """transformers' hypotheses for one prompt: (generated ids without padding, score), best first (memoized: both
    KV layouts compare with the same runs)."""
    key = (tuple(prompt), n, tuple(eos), tuple(sorted(kw.items())))
    if key not in _HF:
        _HF[key] = _hf_beams(model, prompt, n, eos, **kw)
    return _HF[key]


def _hf_beams(model, prompt, n, eos, **kw):
    t = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False,
                             eos_token_id=list(eos), pad_token_id=-1, output_scores=True,
                             return_dict_in_generate=True, **kw)
    seqs = [[x for x in row[len(prompt):].tolist() if x != -1] for row in out.sequences]
    return list(zip(seqs, out.sequences_scores.tolist()))


def frequent_token(model, prompt, n=12):
    """A token greedy decoding of ``prompt`` produces a few steps in: an EOS id that beams actually meet."""
    t = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return int(out[0, len(prompt) + 3])


CASES = [
    {"num_beams": 4},
    {"num_beams": 3, "length_penalty": 0.5, "num_return_sequences": 3},
    {"num_beams": 4, "early_stopping": True, "num_return_sequences": 2},
    {"num_beams": 2, "early_stopping": "never", "length_penalty": 2.0},
    {"num_beams": 4, "length_penalty": -1.0},
    {"num_beams": 4, "no_repeat_ngram_size": 2, "repetition_penalty": 1.3, "min_new_tokens": 5},
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("eos_kind", ["met", "two"])
def test_beam_search_equals_transformers(engine, hf, kw, eos_kind):
    # EOS ids the search actually meets, so hypotheses finish early, are scored, and compete with running beams
    eos = [frequent_token(hf, PROMPTS[0])] + ([frequent_token(hf, PROMPTS[1])] if eos_kind == "two" else [])
    res = engine.generate(input_ids=PROMPTS, max_new_tokens=12, eos_token_ids=eos, **kw)
    nrs = kw.get("num_return_sequences", 1)
    assert len(res) == len(PROMPTS) * nrs
    stopped = 0
    for i, prompt in enumerate(PROMPTS):
        want = hf_beams(hf, prompt, 12, eos, **kw)
        for j in range(nrs):
            r = res[i * nrs + j]
            assert r.token_ids == want[j][0], (i, j)
            assert r.score == pytest.approx(want[j][1], abs=1e-4)
            assert r.prompt_ids == prompt
            assert r.finish_reason == ("stop" if r.token_ids[-1] in eos else "length")
            stopped += r.finish_reason == "stop"
        assert [r.score for r in res[i * nrs:(i + 1) * nrs]] == sorted((r.score for r in res[i * nrs:(i + 1) * nrs]),
                                                                        reverse=True)
    if kw.get("length_penalty", 1.0) <= 1.0:  # (a length penalty of 2 favours the long unfinished ones)
        assert stopped > 0  # EOS really ended returned hypotheses


def test_groups_beyond_the_batch_and_length_limit(tiny_engine, hf):
    """A small batch limit runs prompts in groups; a prompt near max_seq_len stops at it, as max_length would."""
    with trtinfer.load(tiny_engine("llama", max_batch_size=4, max_seq_len=24)) as eng:
        long = list(range(2, 20))  # 18 tokens: room for 6 more
        prompts = [*PROMPTS, long]
        res = eng.generate(input_ids=prompts, max_new_tokens=10, num_beams=2, ignore_eos=True)
        for prompt, r in zip(prompts, res):
            n = min(10, 24 - len(prompt))
            want = hf_beams(hf, prompt, n, [], num_beams=2)
            assert r.token_ids == want[0][0]
            assert len(r.token_ids) == n and r.finish_reason == "length"
        with pytest.raises(InputError, match="num_beams=5 exceeds the engine's max batch size 4"):
            eng.generate(input_ids=PROMPTS, num_beams=5)


def test_beams_on_a_sampling_default_engine(tiny_engine, tmp_path, hf):
    """A model whose generation_config.json samples (Gemma-3, Llama-3 ship do_sample=true): num_beams asks for beam
    search, which does not sample."""
    import json
    import shutil

    eng_dir = tmp_path / "engine"
    shutil.copytree(tiny_engine("llama"), eng_dir)
    cfg = json.loads((eng_dir / "generation_config.json").read_text())
    (eng_dir / "generation_config.json").write_text(json.dumps({**cfg, "do_sample": True, "top_k": 5}))
    with trtinfer.load(eng_dir) as eng:
        r = eng.generate(input_ids=[PROMPTS[0]], max_new_tokens=6, num_beams=3, ignore_eos=True)[0]
    assert r.token_ids == hf_beams(hf, PROMPTS[0], 6, [], num_beams=3)[0][0]


def test_beam_hooks(engine):
    seen_shapes = []

    def processor(ids, scores):
        seen_shapes.append((len(ids), scores.shape))
        scores[:, 7] = np.inf if len(ids[0]) == len(PROMPTS[0]) else scores[:, 7]  # force token 7 first
        return scores

    r = engine.generate(input_ids=[PROMPTS[0]], max_new_tokens=4, num_beams=3, ignore_eos=True,
                        logits_processor=processor)[0]
    assert r.token_ids[0] == 7 and seen_shapes[0][0] == 3  # one row per beam
    calls = []
    r = engine.generate(input_ids=[PROMPTS[0]], max_new_tokens=8, num_beams=2, ignore_eos=True,
                        should_stop=lambda: calls.append(1) or len(calls) >= 3)[0]
    assert r.finish_reason == "cancelled" and len(r.token_ids) == 3


def test_beam_refusals(engine):
    with pytest.raises(InputError, match="beam search cannot stream"):
        list(engine.stream(input_ids=PROMPTS[0], num_beams=2))
    for bad, field in [({"do_sample": True}, "do_sample"), ({"logprobs": True}, "logprobs"),
                       ({"stop": ["x"]}, "stop"), ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens")]:
        with pytest.raises(ConfigError, match=f"beam search \\(num_beams=2\\) does not combine with {field}"):
            engine.generate(input_ids=[PROMPTS[0]], num_beams=2, **bad)
    with pytest.raises(ConfigError, match="num_return_sequences must be within 1..num_beams \\(2\\), got 3"):
        engine.generate(input_ids=[PROMPTS[0]], num_beams=2, num_return_sequences=3)
    with pytest.raises(ConfigError, match="early_stopping must be True, False or \"never\""):
        engine.generate(input_ids=[PROMPTS[0]], num_beams=2, early_stopping="sometimes")


def test_independent_samples_per_prompt(engine):
    """num_return_sequences with sampling and one beam: that many samples per prompt, each its own draws."""
    res = engine.generate(input_ids=PROMPTS[:2], max_new_tokens=8, do_sample=True, temperature=1.5, seed=7,
                          num_return_sequences=3, ignore_eos=True)
    assert len(res) == 6 and [r.prompt_ids for r in res] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert len({tuple(r.token_ids) for r in res[:3]}) > 1  # the copies drew differently
    again = engine.generate(input_ids=PROMPTS[:2], max_new_tokens=8, do_sample=True, temperature=1.5, seed=7,
                            num_return_sequences=3, ignore_eos=True)
    assert [r.token_ids for r in again] == [r.token_ids for r in res]
    with pytest.raises(ConfigError, match="num_return_sequences > 1 needs beam search"):
        engine.generate(input_ids=PROMPTS[:1], num_return_sequences=2)
    with pytest.raises(InputError, match="stream\\(\\) yields one sequence's text"):  # samples would interleave
        list(engine.stream(input_ids=PROMPTS[0], do_sample=True, num_return_sequences=2))
    rows = {ev.index for ev in engine.stream_batch(input_ids=PROMPTS[:2], do_sample=True, seed=7, max_new_tokens=3,
                                                   num_return_sequences=2, ignore_eos=True)}
    assert rows == {0, 1, 2, 3}  # prompt * n + sample


def test_a_served_search_that_pauses_equals_generate(tiny_engine):
    """The server runs beam search on its started scheduler, whose idle refill recomputes finished rows' decoded KV
    after REFILL_DELAY_S: beam steps' rows are not refilled, so a search that pauses between steps (its thread picks
    the beams; here a slow logits hook) continues from the KV its last step decoded, as ``engine.generate``'s does.
    Refilled, the int8 prefill graph's KV moved the scores (14 refills, -3.827012 against -3.827981)."""
    from trtinfer.runtime.beam import BeamSearch
    from trtinfer.runtime.config import GenerationConfig
    from trtinfer.runtime.scheduler import REFILL_DELAY_S, Scheduler

    def slow(ids, scores):
        time.sleep(REFILL_DELAY_S * 1.5)
        return scores

    cfg = GenerationConfig(max_new_tokens=6, num_beams=2, num_return_sequences=2, do_sample=False)
    prompt = np.random.default_rng(3).integers(3, 300, size=12).tolist()
    with trtinfer.load(tiny_engine("llama", prefill="int8")) as eng:
        want = BeamSearch(Scheduler(eng, max_slots=4), [prompt], cfg, drive=True, logits_processor=slow).run()
        with Scheduler(eng, max_slots=4) as sched:
            refills = []
            sched.cache.refill = lambda *a, _r=sched.cache.refill: refills.append(a) or _r(*a)
            got = BeamSearch(sched, [prompt], cfg, drive=False, logits_processor=slow).run()
    assert refills == []
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.score == w.score
