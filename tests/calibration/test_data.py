"""Calibration data: text, JSONL and built-in sources; windows; hashes; bad data refused in one line."""
from __future__ import annotations

import hashlib
import json
from importlib import resources

import pytest

from trtinfer.calibration import (
    BUILTIN_TEXTS,
    DEFAULT_TEXT,
    EVAL_TEXT,
    CalibrationConfig,
    builtin_text,
    calibration_set,
    load_texts,
)
from trtinfer.errors import CalibrationError, ConfigError

TEXT = "The history of the city of Paris begins in antiquity, when a Celtic tribe settled on an island. " * 40


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return tiny_model_dir("llama") / "tokenizer.json"


@pytest.fixture(scope="module")
def bos_tokenizer(tiny_model_dir):
    return tiny_model_dir("gemma3") / "tokenizer.json"  # adds <s> (id 1) in front


def test_builtin_texts_ship_verbatim():
    folder = resources.files("trtinfer.calibration") / "texts"
    assert "GNU Free Documentation License" in builtin_text(DEFAULT_TEXT)
    assert "GNU GENERAL PUBLIC LICENSE" in builtin_text(EVAL_TEXT)
    readme = (folder / "README.md").read_text()
    for file in BUILTIN_TEXTS.values():
        digest = hashlib.sha256((folder / file).read_bytes()).hexdigest()
        assert digest in readme, file  # the README's hashes say the files are unmodified
    with pytest.raises(CalibrationError, match="known: gfdl-1.3, gpl-3.0"):
        builtin_text("wikitext")


def test_sources(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("héllo world\n", encoding="utf-8")
    assert load_texts(txt) == ["héllo world\n"]
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"text": "one"}\n\n{"prompt": "two"}\n"three"\n')
    assert load_texts(jl) == ["one", "two", "three"]
    assert load_texts(None) == [builtin_text(DEFAULT_TEXT)]
    assert load_texts("builtin:gpl-3.0") == [builtin_text(EVAL_TEXT)]


@pytest.mark.parametrize(("name", "content", "message"), [
    ("missing.txt", None, "does not exist"),
    ("empty.txt", b"  \n\n", "is empty"),
    ("latin1.txt", "caf\xe9".encode("latin-1"), "is not UTF-8 text"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": oops}\n', "line 2 is not JSON"),
    ("nokey.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', 'line 2 has no "text" or "prompt"'),
    ("blank.jsonl", b'{"text": "  "}\n', "is empty"),
])
def test_bad_data_is_one_line(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(CalibrationError, match=message) as e:
        load_texts(path)
    assert "\n" not in str(e.value) and e.value.exit_code == 2


def test_windows_are_real_tokens_spread_over_the_text(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    cs = calibration_set(tokenizer, path, num_samples=4, seq_len=16, decode_steps=3)
    assert len(cs) == 4 and cs.num_feeds == 16
    stream = Tokenizer.from_file(str(tokenizer)).encode(TEXT, add_special_tokens=False).ids
    assert all(len(w) == 19 for w in cs.windows)
    step = (len(stream) - 19) // 3
    assert step >= 19  # evenly spread, not overlapping, the last one near the end
    assert [cs.windows[i] == tuple(stream[i * step:i * step + 19]) for i in range(4)] == [True] * 4
    assert len(stream) - (3 * step + 19) < 3


def test_a_tokenizer_with_bos_starts_each_window_with_it(tmp_path, bos_tokenizer):
    path = tmp_path / "t.txt"
    path.write_text(TEXT)
    cs = calibration_set(bos_tokenizer, path, num_samples=3, seq_len=8, decode_steps=2)
    assert all(w[0] == 1 and len(w) == 10 and 1 not in w[1:] for w in cs.windows)


def test_too_short_says_what_was_needed_and_found(tmp_path, tokenizer):
    path = tmp_path / "short.txt"
    path.write_text("A quick brown fox.")
    with pytest.raises(CalibrationError, match=r"too short: 16 samples of 128\+8 tokens need 2176 tokens, it has \d+"):
        calibration_set(tokenizer, path, num_samples=16, seq_len=128, decode_steps=8)


def test_dataset_hash_is_stable_and_follows_data_and_settings(tmp_path, tokenizer):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT)
    b.write_text(TEXT.replace("Paris", "Rome"))
    base = calibration_set(tokenizer, a, num_samples=4, seq_len=16, decode_steps=3)
    assert calibration_set(tokenizer, a, num_samples=4, seq_len=16, decode_steps=3).dataset_hash == base.dataset_hash
    others = [calibration_set(tokenizer, b, num_samples=4, seq_len=16, decode_steps=3),
              calibration_set(tokenizer, a, num_samples=3, seq_len=16, decode_steps=3),
              calibration_set(tokenizer, a, num_samples=4, seq_len=17, decode_steps=2),
              calibration_set(tokenizer, a, num_samples=4, seq_len=16, decode_steps=4)]
    assert len({base.dataset_hash, *(o.dataset_hash for o in others)}) == 5


def test_builtin_default_gives_the_default_sixteen_samples(tokenizer):
    cs = calibration_set(tokenizer, None, num_samples=16, seq_len=128, decode_steps=8)
    assert len(cs) == 16 and cs.source == "the built-in text"


@pytest.mark.parametrize(("kw", "field"), [({"method": "kl"}, "method"), ({"percentile": 0}, "percentile"),
                                           ({"num_samples": 0}, "num_samples"), ({"seq_len": 2.5}, "seq_len"),
                                           ({"decode_steps": -1}, "decode_steps")])
def test_config_is_validated_in_one_line(kw, field):
    with pytest.raises(ConfigError) as e:
        CalibrationConfig(**kw)
    assert e.value.field == field and "\n" not in str(e.value)


def test_config_settings_are_json():
    c = CalibrationConfig(method="percentile", source="x.jsonl")
    assert json.loads(json.dumps(c.settings()))["percentile"] == 99.99
    assert "percentile" not in CalibrationConfig().settings()
