"""Scoring on tiny engines equals PyTorch eager's log-softmax; windows, chunks, errors, `trtinfer eval`."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import trtinfer
from trtinfer.errors import InputError
from trtinfer.runtime.scoring import open_stage_session, score_ids, windowed_perplexity
from trtinfer.runtime.slots import SlotCache

TEXT = ("The history of the city of Paris begins in antiquity, when a Celtic tribe settled on an island. "
        "A quick brown fox jumps over the lazy dog while the cat sleeps in the sun.")


def eager(src, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log p(token t | tokens < t) for t = 1..n-1 (float64), the top-1 predictions, and the top-1 margins."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, -1)
    top2 = logits.topk(2, -1).values
    return (lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy(), logits.argmax(-1).numpy(),
            (top2[:, 0] - top2[:, 1]).numpy())


def assert_matches_eager(src, result, atol: float = 1e-3) -> None:
    ref, top1, margin = eager(src, result.token_ids)
    assert result.logprobs.dtype == np.float32 and result.logprobs.shape == (len(result.token_ids) - 1,)
    np.testing.assert_allclose(result.logprobs, ref, atol=atol, rtol=0)
    clear = margin > 1e-3  # near-ties may flip either way
    assert result.argmax.dtype == np.int64 and (result.argmax[clear] == top1[clear]).all()
    assert result.perplexity == pytest.approx(math.exp(-ref.mean()), rel=1e-3)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2", "qwen3"])
def test_score_equals_eager_log_softmax(arch, tiny_model_dir, tiny_engine):
    """A batch of texts of different lengths (gemma3: BOS added, sliding window 5 exceeded)."""
    src = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(src)
    texts = [TEXT, "Hello world!", "Machine learning models are exported to ONNX"]
    with trtinfer.load(tiny_engine(arch)) as eng:
        results = eng.score(texts)
    assert len(results) == 3
    for text, res in zip(texts, results):
        assert res.token_ids == tok(text).input_ids  # tokenized like tokenizer(text)
        assert_matches_eager(src, res)


def test_concat_layout_and_chunks(tiny_model_dir, tiny_engine):
    """Concat KV (attention fusion off) and shared buffers, scored in chunks of 7 across a 60-token sequence."""
    src = tiny_model_dir("llama")
    ids = np.random.default_rng(0).integers(3, 300, 60).tolist()
    concat = tiny_engine("llama", disable_passes=("attention",))
    with trtinfer.load(concat) as eng:
        assert eng.manifest.raw["kv_layout"] == "concat"
        whole = eng.score(input_ids=[ids])[0]
        chunked = score_ids(eng.session, ids, chunk=7)
    assert_matches_eager(src, whole)
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)
    with trtinfer.load(tiny_engine("llama")) as eng:
        assert eng.manifest.raw["kv_layout"] == "shared_buffer"
        chunked = score_ids(eng.session, ids, chunk=7)
        assert_matches_eager(src, chunked)
        # gemma3's sliding window is covered by the batch test; here: generation after scoring is unchanged
        again = eng.generate(input_ids=[ids[:9]], max_new_tokens=6, ignore_eos=True)[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    t = torch.tensor([ids[:9]])
    with torch.inference_mode():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=6, do_sample=False,
                             pad_token_id=0, eos_token_id=None, min_new_tokens=6)
    assert again == out[0, 9:].tolist()


def test_sliding_window_in_chunks(tiny_model_dir, tiny_engine):
    """Gemma-3 tiny (window 5), chunks of 4 continuing the shared buffers: equal to eager."""
    src = tiny_model_dir("gemma3")
    ids = np.random.default_rng(3).integers(3, 300, 30).tolist()
    with trtinfer.load(tiny_engine("gemma3")) as eng:
        assert_matches_eager(src, score_ids(eng.session, ids, chunk=4))


def test_errors(tiny_engine):
    with trtinfer.load(tiny_engine("llama")) as eng:
        limit = eng.manifest.max_seq_len
        with pytest.raises(InputError, match=f"sequence 1 has {limit + 1} tokens; the engine's max sequence length"):
            eng.score(input_ids=[[5, 6, 7], [5] * (limit + 1)])
        eng.score(input_ids=[[5] * limit])  # exactly the limit is fine
        with pytest.raises(InputError, match="sequence 0 has 1 token"):
            eng.score(input_ids=[[5]])
        with pytest.raises(InputError, match=r"outside the vocabulary \[0, 320\): \[320\]"):
            eng.score(input_ids=[[5, 320]])
        with pytest.raises(InputError, match=r"must hold integer token ids, got 6.5"):
            eng.score(input_ids=[[5, 6.5, 7]])
        with pytest.raises(InputError, match="exactly one of"):
            eng.score()
        with pytest.raises(InputError, match="window must be"):
            eng.perplexity(input_ids=[5, 6, 7], window=limit + 1)
        with pytest.raises(InputError, match="stride must be"):
            eng.perplexity(input_ids=[5, 6, 7], window=4, stride=5)


def test_engine_without_positions_input_generates_but_cannot_score(tiny_model_dir, tiny_engine):
    """With the pass disabled the shared-buffer graph picks each row's last token itself; scoring says rebuild."""
    engine = tiny_engine("llama", disable_passes=("logits_positions",))
    with trtinfer.load(engine) as eng:
        assert "logits_positions" not in [t["name"] for t in eng.manifest.raw["io"]["inputs"]]
        plain = trtinfer.load(tiny_engine("llama"))
        prompts = ["The history of the city", "Hello"]
        assert ([r.token_ids for r in eng.generate(prompts, max_new_tokens=6, ignore_eos=True)]
                == [r.token_ids for r in plain.generate(prompts, max_new_tokens=6, ignore_eos=True)])
        with pytest.raises(InputError, match="last position only.*rebuild"):
            eng.score(["Hello world"])


def test_concat_engine_with_last_position_logits(tiny_engine):
    """A concat graph exported with last-position logits and no logits_positions input: ONNX Runtime's build renames
    its logits' literal 1, so the export's record says what it computes. It builds (its engine check feeds ragged
    prompts), ragged rows of one slot cache get each row's own last logits, and it generates as the default engine."""
    with trtinfer.load(tiny_engine("llama", disable_passes=("attention", "logits_positions"))) as eng, \
            trtinfer.load(tiny_engine("llama")) as plain:
        assert eng.session.kv_layout == "concat" and not eng.session.logits_every_position
        ragged = [[5, 6, 7, 8, 9], [10, 11]]
        got = SlotCache(eng.session, 2, 16).prefill_rows(0, ragged)
        want = [SlotCache(eng.session, 1, 16).prefill(0, p) for p in ragged]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, atol=1e-5)
        prompts = ["The history of the city", "Hello"]
        assert ([r.token_ids for r in eng.generate(prompts, max_new_tokens=6, ignore_eos=True)]
                == [r.token_ids for r in plain.generate(prompts, max_new_tokens=6, ignore_eos=True)])


def test_windowed_perplexity(tiny_model_dir, tiny_engine):
    src = tiny_model_dir("llama")
    ids = np.random.default_rng(1).integers(3, 300, 50).tolist()
    with trtinfer.load(tiny_engine("llama")) as eng:
        whole = eng.score(input_ids=[ids])[0]
        one = eng.perplexity(input_ids=ids)  # default window: the engine's max_seq_len >= 50
        assert one.tokens == 50 and one.scored == 49
        assert one.perplexity == pytest.approx(whole.perplexity, rel=1e-9)
        assert eng.perplexity(input_ids=ids, window=50, stride=3).perplexity == pytest.approx(whole.perplexity)
        got = windowed_perplexity(eng.session, ids, window=12, stride=5, chunk=5)
        cut = eng.perplexity(input_ids=ids + [7, 8], max_tokens=50)
    assert cut.perplexity == pytest.approx(one.perplexity, rel=1e-9)
    # HF's sliding-window method, on eager: windows start every 5 tokens; each scores the tokens not yet scored
    nll, scored, done = 0.0, 0, 0
    for begin in range(0, 50, 5):
        end = min(begin + 12, 50)
        lp, _, _ = eager(src, ids[begin:end])
        new = lp[max(done - begin, 1) - 1:]
        nll, scored, done = nll - new.sum(), scored + len(new), end
        if end == 50:
            break
    assert got.scored == scored == 49 and got.tokens == 50 and (got.window, got.stride) == (12, 5)
    assert got.perplexity == pytest.approx(math.exp(nll / scored), rel=1e-4)
    assert got.perplexity != pytest.approx(one.perplexity, rel=1e-3)  # less context: a different number


def test_stage_session_scores_the_optimize_stage(tiny_model_dir, tiny_engine, tmp_path):
    """No engine directory: the fp32 optimize stage's graph scores as the engine does."""
    from tiny_models import whole_stage

    from trtinfer.export.onnx_export import export
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_stage

    exp = export(tiny_model_dir("llama"), tmp_path / "export")
    with pytest.raises(InputError, match="reads 21 weights from the checkpoint it was exported from"):
        open_stage_session(exp.path)  # its weights are still in the checkpoint: one line, not a session error
    with pytest.raises(InputError, match="last position only"):
        open_stage_session(whole_stage(exp))  # the export keeps its last-token Slice
    opt = optimize_stage(exp, tmp_path / "opt", PassConfig(target="onnxruntime-cpu", max_seq_len=64))
    ids = np.random.default_rng(2).integers(3, 300, 40).tolist()
    with open_stage_session(whole_stage(opt)) as sess:
        got = score_ids(sess, ids)
        with pytest.raises(InputError, match="max sequence length is 64"):
            score_ids(sess, ids * 2)
    with trtinfer.load(tiny_engine("llama")) as eng:
        np.testing.assert_allclose(got.logprobs, eng.score(input_ids=[ids])[0].logprobs, atol=1e-5)


def test_eval_cli_json(tiny_engine, tmp_path, capsys):
    from trtinfer.cli import main

    engine = tiny_engine("gemma3")
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 3, encoding="utf-8")
    assert main(["eval", str(engine), "--text-file", str(text), "--json", "--max-tokens", "60"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"perplexity", "tokens"} and out["tokens"] == 60
    with trtinfer.load(engine) as eng:
        ids = eng.tokenizer.encode(TEXT * 3)[:60]
        assert ids[0] == 1  # Gemma's BOS, as tokenizer(text) adds it
        assert out["perplexity"] == pytest.approx(eng.score(input_ids=[ids])[0].perplexity, rel=1e-6)
    assert main(["eval", str(engine), "--text-file", str(text), "--window", "16", "--stride", "8"]) == 0
    assert "perplexity" in capsys.readouterr().out
    text.write_bytes(b"caf\xe9")
    assert main(["eval", str(engine), "--text-file", str(text)]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert main(["eval", str(engine), "--text-file", str(tmp_path / "missing.txt")]) == 2
    assert main(["eval", str(engine), "--text-file", str(text), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "--max-tokens must be at least 2" in err


@pytest.mark.slow
def test_real_model_score_equals_eager(real_engine, in_user_cache):
    """SmolLM2-135M fp32: 600 tokens of a real text (3 chunks) scored as eager's log-softmax scores them."""
    from pathlib import Path

    from trtinfer.export import resolve_model

    engine = real_engine("smollm2-135m")
    with in_user_cache():
        src = resolve_model("smollm2-135m").path
    gpl = Path("/usr/share/common-licenses/GPL-3")
    text = gpl.read_text() if gpl.is_file() else (Path(__file__).parents[2] / "README.md").read_text()
    with trtinfer.load(engine) as eng:
        ids = eng.tokenizer.encode(text)[:600]
        result = eng.score(input_ids=[ids])[0]
        windowed = eng.perplexity(input_ids=ids, window=256, stride=128)
    assert_matches_eager(src, result)
    assert 1 < result.perplexity < 50  # a real model reads English
    assert windowed.scored == 599 and windowed.perplexity == pytest.approx(result.perplexity, rel=0.2)


def test_logits_all_export_with_shared_buffers(tiny_model_dir, tiny_engine, tmp_path):
    """An export with ``--logits all`` built onto shared KV buffers (right padding): each row's next token comes from
    its own last real position, never a pad column; tokens and scores equal the default engine's."""
    from trtinfer.builder import BuildConfig, build
    from trtinfer.export import ExportConfig

    eng_all = build(tiny_model_dir("llama"), tmp_path / "all", BuildConfig(export=ExportConfig(logits="all")),
                    progress=False)
    prompts = [[5, 17, 42, 99, 7, 3, 250, 11, 60], [8, 9, 10], [200, 201]]  # ragged: short rows are right-padded
    ids = list(range(3, 40))
    with trtinfer.load(eng_all) as a, trtinfer.load(tiny_engine("llama")) as b:
        assert a.manifest.raw["kv_layout"] == "shared_buffer" and not a.session.has_logits_positions
        got = a.generate(input_ids=prompts, max_new_tokens=6, ignore_eos=True)
        want = b.generate(input_ids=prompts, max_new_tokens=6, ignore_eos=True)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        np.testing.assert_allclose(a.score(input_ids=[ids])[0].logprobs, b.score(input_ids=[ids])[0].logprobs,
                                   atol=1e-5)
