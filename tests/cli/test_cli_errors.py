"""Bad input on the command line: one `trtinfer VERB: error:` line naming the flag or file, never "internal error"."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args: str | bytes | Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m trtinfer ARGS``; bytes arguments reach the process as raw (possibly non-UTF-8) bytes."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    argv = [a if isinstance(a, bytes) else str(a) for a in args]
    return subprocess.run([sys.executable, "-m", "trtinfer", *argv], check=False, capture_output=True, text=True,
                          errors="replace", env=env)


def error_line(p: subprocess.CompletedProcess[str]) -> str:
    """The last ``trtinfer ...`` line of stderr, after checking the run failed cleanly."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("trtinfer")]
    assert lines, p.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def engine(tiny_engine) -> Path:
    return tiny_engine("llama", max_batch_size=2, max_seq_len=24)


# --- text that is not UTF-8 --------------------------------------------------------------------------------------
def test_generate_non_utf8_prompt(engine):
    line = error_line(cli("generate", engine, "-p", b"\xff\xfe", "-n", "2"))
    assert line == ("trtinfer generate: error: --prompt 1 is not valid UTF-8 text (byte 0xff at position 0); "
                    "pass UTF-8 text")
    line = error_line(cli("generate", engine, "-p", "fine", "-p", b"caf\xc3(", "-n", "2"))
    assert "--prompt 2 is not valid UTF-8 text (byte 0xc3 at position 3)" in line
    assert "--stop 1 is not valid UTF-8 text" in error_line(cli("generate", engine, "-p", "hi", "--stop", b"\xfe"))


def test_embed_non_utf8_text(tmp_path):
    line = error_line(cli("embed", tmp_path, "--text", "ok", "--text", b"\xff"))
    assert "embed: error: --text 2 is not valid UTF-8 text (byte 0xff at position 0); pass UTF-8 text" in line


# --- option errors: under the flag's name, before the engine loads -------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "--temperature must be > 0, got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
    (["-n", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["-n", "2", "--min-new-tokens", "5"], "--min-new-tokens must be within 0..--max-new-tokens (2), got 5"),
    (["--top-k", "-3"], "--top-k must be >= 0 (0 disables it), got -3"),
    (["--top-p", "1.5"], "--top-p must be within (0, 1], got 1.5"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0, got 0.0"),
    (["--seed", "-1"], "--seed must be a non-negative integer"),
    (["--stop", ""], "--stop must be a list of non-empty strings"),
    (["--stream", "-p", "second"], "--stream takes exactly one --prompt, got 2"),
])
def test_bad_flag_is_reported_before_loading(flags, needle, tmp_path):
    # tmp_path is not an engine directory: the flag error must come first, so the engine is never loaded
    line = error_line(cli("generate", tmp_path, "-p", "hi", *flags))
    assert line.startswith("trtinfer generate: error: ") and needle in line


def test_non_integer_flag_is_argparse_error(tmp_path):
    p = cli("generate", tmp_path, "-p", "hi", "--max-new-tokens", "abc")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "argument -n/--max-new-tokens: invalid int value: 'abc'" in p.stderr.strip().splitlines()[-1]


def test_good_flags_still_generate(engine):
    out = json.loads(cli("generate", engine, "-p", "Hello", "-n", "3", "--seed", "7", "--top-k", "5",
                         "--temperature", "0.8", "--json").stdout)
    again = json.loads(cli("generate", engine, "-p", "Hello", "-n", "3", "--seed", "7", "--top-k", "5",
                           "--temperature", "0.8", "--json").stdout)
    assert 1 <= len(out[0]["token_ids"]) <= 3 and out[0]["token_ids"] == again[0]["token_ids"]


# --- broken engine directories -----------------------------------------------------------------------------------
def test_malformed_manifest(engine, tmp_path):
    eng = tmp_path / "eng"
    shutil.copytree(engine, eng)
    m = json.loads((eng / "manifest.json").read_text())
    m["limits"]["max_batch_size"] = "abc"
    (eng / "manifest.json").write_text(json.dumps(m))
    line = error_line(cli("generate", eng, "-p", "hi"))
    assert f"{eng / 'manifest.json'}: limits.max_batch_size should be a positive integer, found 'abc'" in line
    assert line.endswith("rebuild the engine")
    (eng / "manifest.json").write_text("[1, 2]")
    assert "should hold a JSON object, found a list ([1, 2])" in error_line(cli("generate", eng, "-p", "hi"))


def test_corrupt_tokenizer(engine, tmp_path):
    eng = tmp_path / "eng"
    shutil.copytree(engine, eng)
    text = (eng / "tokenizer.json").read_bytes()
    (eng / "tokenizer.json").write_bytes(text[: len(text) // 3])
    line = error_line(cli("generate", eng, "-p", "hi"))
    assert f"{eng / 'tokenizer.json'} is not a readable tokenizer (" in line and line.endswith("rebuild the engine")


# --- an output path that cannot become a folder ------------------------------------------------------------------
@pytest.mark.parametrize("verb,below", [("build", "engine"), ("export", "sub/out")])
def test_output_under_a_file(verb, below, tiny_model_dir, tmp_path):
    blocker = tmp_path / "SOMEFILE"
    blocker.write_text("not a folder")
    out = blocker / below
    p = cli(verb, tiny_model_dir("llama"), "-o", out)
    line = error_line(p)
    assert line == f"trtinfer {verb}: error: cannot create {out}: {blocker} is a file; choose another -o"
    assert "traced" not in p.stderr + p.stdout  # refused before the export ran, not after the whole build
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SOMEFILE"]  # nothing half-written beside it
    assert blocker.read_text() == "not a folder"


def test_cache_under_a_file(tiny_model_dir, tmp_path):
    blocker = tmp_path / "SOMEFILE"
    blocker.write_text("")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TRTINFER_CACHE": str(blocker / "cache")}
    p = subprocess.run([sys.executable, "-m", "trtinfer", "build", str(tiny_model_dir("llama")), "-o",
                        str(tmp_path / "engine")], check=False, capture_output=True, text=True, env=env)
    assert error_line(p) == (f"trtinfer build: error: cannot create {blocker / 'cache'}: {blocker} is a file; "
                             "point TRTINFER_CACHE at another folder")
    assert not (tmp_path / "engine").exists()


def test_provider_flag_offers_the_runtimes_providers_and_parsing_loads_no_runtime():
    """``--provider``'s choices are the runtime's providers (written twice so that parsing loads no runtime: held
    equal here), every verb that loads an engine offers them, and a bad one is argparse's one line."""
    from trtinfer.cli._flags import PROVIDER_CHOICES
    from trtinfer.runtime.config import PROVIDERS

    assert PROVIDER_CHOICES == PROVIDERS
    for verb in ("generate", "eval", "serve", "triton"):
        p = cli(verb, "--help")
        assert p.returncode == 0 and "{cpu,cuda,tensorrt}" in p.stdout, (verb, p.stdout)
    line = error_line(cli("generate", "nowhere", "-p", "hi", "--provider", "gpu"))
    assert "--provider" in line and "invalid choice: 'gpu'" in line, line
    code = ("import sys; from trtinfer.cli import parser; parser(); "
            "print(sorted(m for m in sys.modules if m.startswith('trtinfer.runtime')))")
    probe = subprocess.run([sys.executable, "-c", code],
                           check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert probe.stdout.strip() == "[]", probe.stdout


# --- a model folder or flags the build cannot use (found by a review) -------------------------------------------
@pytest.mark.parametrize(("change", "says"), [
    ({"model_type": None}, "has no model_type"),
    ({"num_hidden_layers": 0}, "says num_hidden_layers 0: a model needs at least 1"),
])
def test_a_config_without_a_model_is_one_line(tiny_model_dir, tmp_path, change, says):
    """model_type null printed transformers' paragraphs; 0 layers failed in the trace with an IndexError."""
    src = shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    line = error_line(cli("export", src, "-o", tmp_path / "out"))
    assert says in line and "re-download" in line
    assert not (tmp_path / "out").exists()


def test_gguf_precision_needs_a_gguf(tiny_model_dir, tmp_path):
    """--precision gguf on a safetensors folder was refused only after its export and optimize had run."""
    line = error_line(cli("build", tiny_model_dir("llama"), "-o", tmp_path / "e", "--precision", "gguf"))
    assert "--precision gguf keeps a GGUF file's own blocks" in line and "not a GGUF" in line


def test_next_step_hints_quote_paths(tiny_model_dir, tmp_path):
    out = tmp_path / "with space" / "exp"
    p = cli("export", tiny_model_dir("llama"), "-o", out)
    assert p.returncode == 0, p.stderr
    assert f"trtinfer build '{out}' -o ENGINE" in p.stdout


def test_the_log_keeps_a_bugs_traceback():
    """The CLI's log formatter printed only the message: a server's 500 said "the server log has the details", and
    the log had none. Bad input is never logged with its exception; a bug is, at ERROR."""
    import logging

    from trtinfer.cli import _PersonFormatter

    try:
        raise KeyError("slot table corrupted")
    except KeyError:
        err = logging.LogRecord("trtinfer.runtime.scheduler", logging.ERROR, __file__, 1, "scheduler step failed",
                                None, sys.exc_info())
        dbg = logging.LogRecord("trtinfer.export", logging.DEBUG, __file__, 1, "in the child", None, sys.exc_info())
    out = _PersonFormatter().format(err)
    assert out.startswith("error: scheduler step failed\nTraceback") and "KeyError: 'slot table corrupted'" in out
    assert _PersonFormatter().format(dbg) == "in the child"
    assert "Traceback" in _PersonFormatter(debug=True).format(dbg)
