"""Batched ragged generation on tiny engines equals transformers' generate per prompt; sampling features."""
from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, stage_engine, whole_stage
from transformers import AutoModelForCausalLM, AutoTokenizer

import trtinfer

PROMPTS = ["The history of the city", "Hello", "A quick brown fox jumps over the lazy dog while the cat"]


def hf_greedy(src, prompt_ids, n, **kw):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kw)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_ragged_greedy_equals_hf(arch, tiny_model_dir, tiny_engine):
    src = tiny_model_dir(arch)
    with trtinfer.load(tiny_engine(arch)) as eng:
        results = eng.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        tok = AutoTokenizer.from_pretrained(src)
        for prompt, res in zip(PROMPTS, results):
            ids = tok(prompt).input_ids
            assert res.prompt_ids == ids
            assert res.token_ids == hf_greedy(src, ids, 10, eos_token_id=None, min_new_tokens=10)
            assert res.finish_reason == "length"
            single = eng.generate([prompt], max_new_tokens=10, ignore_eos=True)[0]
            assert single.token_ids == res.token_ids  # every row equals its single-prompt result


def test_sliding_window_beyond_window_equals_hf(tiny_model_dir, tiny_engine):
    """Gemma-3 tiny has window 5: a 30-token prompt and 12 new tokens run far past it."""
    src = tiny_model_dir("gemma3")
    ids = list(range(5, 35))
    with trtinfer.load(tiny_engine("gemma3")) as eng:
        out = eng.generate(input_ids=[ids, ids[:7]], max_new_tokens=12, ignore_eos=True)
    assert out[0].token_ids == hf_greedy(src, ids, 12, eos_token_id=None, min_new_tokens=12)
    assert out[1].token_ids == hf_greedy(src, ids[:7], 12, eos_token_id=None, min_new_tokens=12)


def test_finished_rows_leave_batch_and_others_continue(tiny_model_dir, tiny_engine):
    """Make row 0 stop early on EOS; the remaining rows (compacted KV) still equal HF."""
    src = tiny_model_dir("llama")
    with trtinfer.load(tiny_engine("llama")) as eng:
        ref = eng.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
        eos = ref[0].token_ids[2]
        assert all(eos not in r.token_ids[:8] for r in ref[1:]), "pick a prompt set where only row 0 hits EOS"
        out = eng.generate(PROMPTS, max_new_tokens=8, eos_token_ids=[eos])
    assert out[0].finish_reason == "stop"
    assert out[0].token_ids == ref[0].token_ids[: ref[0].token_ids.index(eos) + 1]
    assert len(out[0].timings.decode_ms) < len(out[1].timings.decode_ms)
    for r, full in zip(out[1:], ref[1:]):
        assert r.token_ids == full.token_ids and r.finish_reason == "length"
    tok = AutoTokenizer.from_pretrained(src)
    assert out[0].token_ids == hf_greedy(src, tok(PROMPTS[0]).input_ids, 8, eos_token_id=eos)


def test_seeded_sampling_is_reproducible_and_varies(tiny_engine):
    with trtinfer.load(tiny_engine("llama")) as eng:
        kw = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "ignore_eos": True}
        a = eng.generate(PROMPTS, seed=7, **kw)
        b = eng.generate(PROMPTS, seed=7, **kw)
        c = eng.generate(PROMPTS, seed=8, **kw)
        greedy = eng.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
        top1 = eng.generate(PROMPTS, seed=3, max_new_tokens=12, do_sample=True, top_k=1, ignore_eos=True)
        nucleus = eng.generate(PROMPTS, seed=3, max_new_tokens=12, do_sample=True, top_p=1e-6, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    assert [r.token_ids for r in a] != [r.token_ids for r in greedy]
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]
    assert [r.token_ids for r in nucleus] == [r.token_ids for r in greedy]


def test_repetition_penalty_and_min_new_tokens_match_hf(tiny_model_dir, tiny_engine):
    src = tiny_model_dir("qwen2")
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(PROMPTS[0]).input_ids
    with trtinfer.load(tiny_engine("qwen2")) as eng:
        rp = eng.generate(input_ids=[ids], max_new_tokens=12, repetition_penalty=1.8, ignore_eos=True)[0]
        assert rp.token_ids == hf_greedy(src, ids, 12, repetition_penalty=1.8, eos_token_id=None, min_new_tokens=12)
        first = eng.generate(input_ids=[ids], max_new_tokens=1)[0].token_ids[0]
        stopped = eng.generate(input_ids=[ids], max_new_tokens=10, eos_token_ids=[first])[0]
        assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
        held = eng.generate(input_ids=[ids], max_new_tokens=10, min_new_tokens=4, eos_token_ids=[first])[0]
        assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
        assert held.token_ids == hf_greedy(src, ids, 10, eos_token_id=first, min_new_tokens=4)[: len(held.token_ids)]


def test_greedy_with_processors_runs_them(tiny_model_dir, tiny_engine):
    """Greedy decoding with a processor that changes logits (no-repeat n-grams, penalties) reads the logits on the
    host: the device-argmax shortcut is for plain greedy only."""
    src, ids = tiny_model_dir("llama"), [7, 8, 9]  # plain greedy repeats itself from there: 85 16 85 16 ...
    with trtinfer.load(tiny_engine("llama")) as eng:
        plain = eng.generate(input_ids=[ids], max_new_tokens=12, ignore_eos=True)[0].token_ids
        ngram = eng.generate(input_ids=[ids], max_new_tokens=12, ignore_eos=True, no_repeat_ngram_size=2)[0]
        presence = eng.generate(input_ids=[ids], max_new_tokens=12, ignore_eos=True, presence_penalty=2.0)[0]
    assert ngram.token_ids == hf_greedy(src, ids, 12, no_repeat_ngram_size=2, eos_token_id=None, min_new_tokens=12)
    assert ngram.token_ids != plain and presence.token_ids != plain


def test_stop_strings_and_streaming(tiny_engine):
    with trtinfer.load(tiny_engine("llama")) as eng:
        full = eng.generate([PROMPTS[2]], max_new_tokens=16, ignore_eos=True)[0]
        assert len(full.text) > 6
        stop = full.text[3:6]
        cut = eng.generate([PROMPTS[2]], max_new_tokens=16, ignore_eos=True, stop=[stop])[0]
        assert cut.finish_reason == "stop"
        assert cut.text == full.text[: full.text.find(stop)]
        assert len(cut.token_ids) < len(full.token_ids)
        streamed = "".join(eng.stream(PROMPTS[2], max_new_tokens=16, ignore_eos=True))
        assert streamed == full.text
        streamed_cut = "".join(eng.stream(PROMPTS[2], max_new_tokens=16, ignore_eos=True, stop=stop))
        assert streamed_cut == cut.text
        events = list(eng.stream_batch(PROMPTS, max_new_tokens=5, ignore_eos=True))
        assert {e.index for e in events} == {0, 1, 2}
        assert sum(e.finish_reason is not None for e in events) == 3


def test_a_stop_string_keeps_its_tokens_and_leaves_the_text(tiny_engine):
    """vLLM's rule: token_ids run up to the token that completed the stop string, text ends where it starts."""
    with trtinfer.load(tiny_engine("llama")) as eng:
        decode = eng.tokenizer.decode
        full = eng.generate([PROMPTS[2]], max_new_tokens=16, ignore_eos=True)[0]
        assert full.stop_reason is None and full.text == decode(full.token_ids)
        stop = full.text[3:6]
        cut = eng.generate([PROMPTS[2]], max_new_tokens=16, ignore_eos=True, stop=["never seen", stop])[0]
        completed = next(k for k in range(1, 17) if stop in decode(full.token_ids[:k]))
        assert cut.token_ids == full.token_ids[:completed]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        text = decode(cut.token_ids)
        assert cut.text == text[: text.find(stop)] != text
        streamed = [e for e in eng.stream_batch(input_ids=[cut.prompt_ids], max_new_tokens=16, ignore_eos=True,
                                                stop=[stop])]
        assert [e.token_id for e in streamed] == cut.token_ids and "".join(e.text for e in streamed) == cut.text
        eos = full.token_ids[4]
        by_eos = eng.generate([PROMPTS[2]], max_new_tokens=16, eos_token_ids=[eos])[0]
        assert by_eos.stop_reason == eos and by_eos.token_ids[-1] == eos and by_eos.text == decode(by_eos.token_ids)


def test_generate_without_streaming_detokenizes_once_per_row(tiny_engine, monkeypatch):
    """No stream, no stop strings: no per-step text; each row's text is one decode of its ids at the end."""
    from trtinfer.runtime.tokenizer import IncrementalDecoder

    with trtinfer.load(tiny_engine("llama")) as eng:
        want = [r.text for r in eng.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)]
        calls = []
        decode = eng.tokenizer.decode
        monkeypatch.setattr(eng.tokenizer, "decode", lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw))
        monkeypatch.setattr(IncrementalDecoder, "add", lambda *a: pytest.fail("decoded per step"))
        gen = eng._generation(PROMPTS, None, False, None, {"max_new_tokens": 12, "ignore_eos": True})
        assert [r.text for r in gen.run()] == want
        assert calls == [12, 12, 12]


def test_chat_template_matches_transformers(tiny_model_dir, tiny_engine):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    with trtinfer.load(tiny_engine("llama")) as eng:
        msgs = [{"role": "user", "content": "Hello world!"}]
        ref = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert eng.tokenizer.encode_chat(msgs) == list(ref)
        res = eng.generate(["Hello world!"], chat=True, max_new_tokens=3, ignore_eos=True)[0]
        assert res.prompt_ids == list(ref)


def test_timings_are_reported(tiny_engine):
    with trtinfer.load(tiny_engine("llama")) as eng:
        r = eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)[0]
    t = r.timings.to_dict()
    assert t["prefill_ms"] > 0 and t["decode_steps"] == 5 and t["decode_tokens_per_s"] > 0
    assert t["batch_size"] == 3 and t["prompt_tokens"] == len(r.prompt_ids)


# --- a row's length budget is its own -----------------------------------------------------------------------------
SHORT_MAX_SEQ = 24
LONG_ROW, SHORT_ROW = list(range(5, 25)), [7, 8, 9]  # 20 and 3 tokens: the long row has room for 4 new tokens


def _generate_ids(layout, tiny_model_dir, tiny_engine, monkeypatch, rows, **kw):
    """Greedy results of ``rows`` on a tiny Llama of max_seq_len 24 whose session has KV layout ``layout``."""
    if layout != "scatter_buffer":
        extra = {"disable_passes": ("attention",)} if layout == "concat" else {}
        with trtinfer.load(tiny_engine("llama", max_batch_size=2, max_seq_len=SHORT_MAX_SEQ, **extra)) as eng:
            assert eng.session.kv_layout == layout
            return eng.generate(input_ids=rows, **kw)
    # the tensorrt target's graph on ONNX Runtime CPU (as in test_scatter_layout), driven by Generation directly
    from trtinfer.export import ExportConfig
    from trtinfer.export.onnx_export import export_cached
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_cached
    from trtinfer.runtime.config import GenerationConfig
    from trtinfer.runtime.offline import Generation
    from trtinfer.runtime.scoring import open_stage_session
    from trtinfer.runtime.tokenizer import EngineTokenizer

    stage = optimize_cached(export_cached(tiny_model_dir("llama"), ExportConfig()),
                            PassConfig(target="tensorrt", max_seq_len=SHORT_MAX_SEQ))
    with open_stage_session(whole_stage(stage)) as session:
        assert session.kv_layout == layout
        tok = EngineTokenizer(stage.path, stage.info.get("tokenizer", {}))
        gen = Generation(stage_engine(session, tok, 2, SHORT_MAX_SEQ), rows, GenerationConfig(**kw))
        list(gen.events())
        return gen.results


@pytest.mark.parametrize("layout", ["shared_buffer", "concat", "scatter_buffer"])
def test_each_row_is_bounded_by_its_own_length(layout, tiny_model_dir, tiny_engine, monkeypatch):
    """max_seq_len 24: next to a 20-token prompt, a 3-token prompt still runs until its own length reaches 24."""
    def run(rows):
        return _generate_ids(layout, tiny_model_dir, tiny_engine, monkeypatch, rows, max_new_tokens=40, ignore_eos=True)

    long, short = run([LONG_ROW, SHORT_ROW])
    assert len(long.token_ids) == SHORT_MAX_SEQ - len(LONG_ROW) and long.finish_reason == "length"
    assert len(short.token_ids) == SHORT_MAX_SEQ - len(SHORT_ROW) and short.finish_reason == "length"
    alone = run([SHORT_ROW])[0]
    assert short.token_ids == alone.token_ids
    assert short.token_ids == hf_greedy(tiny_model_dir("llama"), SHORT_ROW, len(short.token_ids), eos_token_id=None,
                                        min_new_tokens=len(short.token_ids))
