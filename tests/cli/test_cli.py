"""CLI round trip and one-line errors (subprocess, as a user runs it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def cli(*args, check=True):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-m", "trtinfer", *map(str, args)], check=False, capture_output=True, text=True, env=env)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def assert_one_line_error(p, needle):
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("trtinfer")]
    assert lines and needle in lines[-1], p.stderr


def test_build_generate_inspect_round_trip(tiny_model_dir, tmp_path):
    out = tmp_path / "eng"
    p = cli("-q", "build", tiny_model_dir("llama"), "-o", out, "--max-batch-size", "4")
    assert "built" in p.stdout
    g = json.loads(cli("generate", out, "-p", "Hello", "-p", "The history", "-n", "5", "--json").stdout)
    assert len(g) == 2 and all(len(r["token_ids"]) <= 5 for r in g)
    s = cli("generate", out, "-p", "Hello", "-n", "5", "--stream", "--min-new-tokens", "5")
    same = json.loads(cli("generate", out, "-p", "Hello", "-n", "5", "--min-new-tokens", "5", "--json").stdout)
    assert s.stdout.rstrip("\n") == same[0]["text"] and len(same[0]["token_ids"]) == 5  # streamed = returned text
    base = ["generate", out, "-p", "Hello", "-n", "8", "--chat", "--json", "--min-new-tokens", "8"]
    sampled = [*base, "--seed", "1", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9"]
    chat = json.loads(cli(*sampled).stdout)
    assert chat[0]["timings"]["prompt_tokens"] > 2 and len(chat[0]["token_ids"]) == 8
    assert json.loads(cli(*sampled).stdout)[0]["token_ids"] == chat[0]["token_ids"]  # the seed is honoured
    greedy = json.loads(cli(*base).stdout)
    hot = json.loads(cli(*base, "--seed", "2", "--temperature", "5").stdout)
    assert hot[0]["token_ids"] != greedy[0]["token_ids"]  # a hot sampling run leaves the greedy path
    m = json.loads(cli("inspect", out, "--json").stdout)
    assert m["limits"]["max_batch_size"] == 4 and m["op_histogram"]["MatMul"] > 0
    assert m["export"]["validation"]["passed"]
    assert "SimplifiedLayerNormalization" in cli("inspect", out).stdout
    bad = cli("build", tiny_model_dir("llama"), "-o", out, check=False)
    assert_one_line_error(bad, "already exists")


@pytest.mark.parametrize("args,needle", [
    (["build", "/nonexistent/model", "-o", "{tmp}/x"], "not found"),
    (["build", "{src}", "-o", "{tmp}/x", "--precision", "int3"], "precision"),
    (["build", "{src}", "-o", "{tmp}/x", "--backend", "foo"], "unknown backend"),
    (["build", "{src}", "-o", "{tmp}/x", "--precision", "bf16"], "bf16 needs a GPU target"),
    (["build", "{src}", "-o", "{tmp}/x", "--precision", "fp16", "--keep-fp32", "norms,attn"], "unknown --keep-fp32"),
    (["optimize", "{tmp}/none.onnx", "-o", "{tmp}/x.onnx", "--precision", "fp16"], "does not exist"),
    (["generate", "{tmp}/none", "-p", "hi"], "does not exist"),
    (["generate", "{src}/config.json", "-p", "hi"], "is a file, not an engine directory"),
    (["build", "", "-o", "{tmp}/x"], "argument model: an empty path"),
    (["triton", "{tmp}", "-o", " "], "argument -o/--output: an empty path"),
    (["inspect", "{tmp}"], "manifest.json"),
    (["bench", "{tmp}/none"], "does not exist"),
    (["build", "{src}", "-o", "{tmp}/x", "--method", "rtn"], "--method applies to a quantized --precision"),
    (["build", "{src}", "-o", "{tmp}/x", "--include", "q_proj"], "--include applies to a quantized --precision"),
    (["build", "{src}", "-o", "{tmp}/x", "--opt-batch-size", "2"], "--opt-batch-size applies to --backend tensorrt"),
    (["build", "{src}", "-o", "{tmp}/x", "--keep-fp32", "norms"], "--keep-fp32 applies to fp16/bf16 and quantized"),
    (["build", "{src}", "-o", "{tmp}/x", "--precision", "int4", "--keep-io-types"], "--keep-io-types applies"),
])
def test_bad_input_is_one_line(args, needle, tiny_model_dir, tmp_path):
    args = [a.format(tmp=tmp_path, src=tiny_model_dir("llama")) for a in args]
    p = cli(*args, check=False)
    assert_one_line_error(p, needle)
    assert not (tmp_path / "x").exists()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".x.tmp")]


def test_failed_build_leaves_nothing(tmp_path):
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "m")
    p = cli("build", tmp_path / "m", "-o", tmp_path / "eng", check=False)
    assert_one_line_error(p, "not supported")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m"]


def test_generate_bad_options_one_line(tiny_engine):
    eng = tiny_engine("llama")
    assert_one_line_error(cli("generate", eng, "-p", "hi", "--temperature", "-1", check=False), "temperature")
    assert_one_line_error(cli("generate", eng, "-p", "a", "-p", "b", "--stream", check=False), "exactly one")
    p = cli("generate", eng, "-p", "hi", "--top-p", "2", "--debug", check=False)
    assert p.returncode != 0 and "Traceback" in p.stderr  # --debug shows it


def test_inspect_a_manifest_short_of_its_summary(tiny_engine, tmp_path):
    """A manifest that loads (generate runs) but lacks a part of inspect's summary: one line pointing at --json
    (was 'internal error: KeyError: 'export'', exit 1)."""
    import shutil

    eng = shutil.copytree(tiny_engine("llama"), tmp_path / "eng")
    m = json.loads((eng / "manifest.json").read_text())
    del m["export"]
    (eng / "manifest.json").write_text(json.dumps(m))
    p = cli("inspect", eng, check=False)
    assert p.returncode == 2
    assert_one_line_error(p, "manifest.json lacks or mistypes 'export' for the summary; rebuild the engine, or read "
                             "it whole with --json")
    assert json.loads(cli("inspect", eng, "--json").stdout)["limits"]


def test_outputs_that_cannot_be_made_are_one_line(tiny_engine, tmp_path):
    """A cache or an output where no folder can be made (/proc): one line naming it (was 'internal error')."""
    p = subprocess.run([sys.executable, "-m", "trtinfer", "cache", "info"], check=False, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": os.getcwd(), "TRTINFER_CACHE": "/proc/trtinfer-x"})
    assert_one_line_error(p, "cannot create the trtinfer cache /proc/trtinfer-x")
    assert p.returncode == 2
    p = cli("triton", tiny_engine("llama"), "-o", "/proc/trtinfer-repo", check=False)
    assert_one_line_error(p, "cannot create /proc/trtinfer-repo")
    assert p.returncode == 2


def test_config_errors_read_in_flags_without_garbling_words():
    from trtinfer.cli._flags import config_from_flags
    from trtinfer.cli.serve import SERVE_FLAGS
    from trtinfer.errors import ConfigError
    from trtinfer.serving.config import ServeConfig

    with pytest.raises(ConfigError) as e:
        config_from_flags(ServeConfig, SERVE_FLAGS, host="")
    assert str(e.value).startswith("--host must be a host name or address"), e.value  # not "a --host name"
    with pytest.raises(ConfigError) as e:
        config_from_flags(ServeConfig, SERVE_FLAGS, max_slots=0)
    assert str(e.value).startswith("--max-slots must be an integer >= 1, got 0") and "None" not in str(e.value)


def test_bench_misuse_is_said_before_any_run(tiny_engine, tmp_path):
    eng = tiny_engine("llama")
    limits = json.loads((eng / "manifest.json").read_text())["limits"]
    too_big = cli("bench", eng, "-b", limits["max_batch_size"] + 1, "--no-eager", check=False)
    assert_one_line_error(too_big, f"batch size {limits['max_batch_size'] + 1} exceeds the engine's maximum")
    assert too_big.returncode == 2 and "--max-batch-size" in too_big.stderr
    too_long = cli("bench", eng, "--prompt-len", limits["max_seq_len"], "--no-eager", check=False)
    assert_one_line_error(too_long, "positions")
    small = cli("bench", eng, "--new-tokens", "1", "--no-eager", check=False)
    assert_one_line_error(small, "new_tokens (--new-tokens) must be an integer >= 2, got 1")
    (tmp_path / "enc").mkdir()
    (tmp_path / "enc" / "manifest.json").write_text("{}")
    assert_one_line_error(cli("bench", tmp_path / "enc", check=False), "rebuild the engine")


def test_huge_pages_flag_reaches_the_session(tiny_engine, tmp_path, monkeypatch, capsys):
    """``--huge-pages`` / ``--no-huge-pages`` reach the CPU session (counted where it decides to collapse its packed
    weights onto huge pages): off by default for generate and eval (one-off runs keep the faster load), on for
    serve."""
    import argparse

    from trtinfer.cli import main
    from trtinfer.cli.serve import add_parser, config_from_args
    from trtinfer.runtime import page_out

    collapse, calls = page_out.collapse_resident_memory, []
    monkeypatch.setattr(page_out, "collapse_resident_memory", lambda: calls.append(1) or collapse())
    path = str(tiny_engine("llama"))
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4, encoding="utf-8")
    for verb in (["generate", path, "--prompt", "hi", "--max-new-tokens", "2"],
                 ["eval", path, "--text-file", str(text), "--json"]):
        for flag, want in (("--no-huge-pages", False), ("--huge-pages", True), (None, False)):
            calls.clear()
            assert main(verb + ([flag] if flag else [])) == 0
            assert bool(calls) is want, (verb[0], flag)
    capsys.readouterr()
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    for argv, want in ((["E"], True), (["E", "--no-huge-pages"], False)):
        assert config_from_args(sub.choices["serve"].parse_args(argv)).runtime().huge_pages is want


def test_no_spinning_lets_the_workers_sleep_and_changes_no_token(tiny_engine, capsys):
    """``--no-spinning`` (``RuntimeConfig.spinning=False``) sets ONNX Runtime's ``session.intra_op.allow_spinning`` to
    0 on the engine's sessions, for serve (its config) and the one-off verbs; the default leaves ONNX Runtime's own
    (spinning). The tokens are the same either way."""
    import argparse

    import trtinfer
    from trtinfer.cli import main
    from trtinfer.cli.serve import add_parser, config_from_args
    from trtinfer.runtime.config import RuntimeConfig
    from trtinfer.runtime.ort_env import NO_SPINNING

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    for argv, want in ((["E"], True), (["E", "--no-spinning"], False), (["E", "--spinning"], True)):
        assert config_from_args(sub.choices["serve"].parse_args(argv)).runtime().spinning is want
    path = tiny_engine("llama")
    with trtinfer.load(path, RuntimeConfig(spinning=False)) as sleeping, trtinfer.load(path) as spinning:
        assert sleeping.session.sess.get_session_options().get_session_config_entry(NO_SPINNING) == "0"
        with pytest.raises(RuntimeError, match="does not have configuration"):
            spinning.session.sess.get_session_options().get_session_config_entry(NO_SPINNING)
        prompts = [[3, 5, 7, 11], [13, 17]]
        got = sleeping.generate(input_ids=prompts, max_new_tokens=6)
        assert [r.token_ids for r in got] == [r.token_ids for r in spinning.generate(input_ids=prompts,
                                                                                     max_new_tokens=6)]
    texts = []
    for flag in ("--no-spinning", "--spinning"):
        assert main(["generate", str(path), "--prompt", "hi", "--max-new-tokens", "4", flag]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    with pytest.raises(trtinfer.errors.ConfigError, match="spinning must be"):
        RuntimeConfig(spinning="no")  # type: ignore[arg-type]
