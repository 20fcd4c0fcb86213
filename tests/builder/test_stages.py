"""Stages compose: export -> optimize -> build, each from the previous one's directory; rebuilds reuse every stage;
a damaged cache entry or a modified stage directory is never trusted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trtinfer
from trtinfer.artifact import read_stage
from trtinfer.builder import BuildConfig, build
from trtinfer.errors import ConfigError, ModelSourceError
from trtinfer.export import ExportConfig, export
from trtinfer.passes import PassConfig
from trtinfer.passes.optimizer import optimize_stage

PROMPTS = ["Hello", "The history of the city", "A quick brown fox"]


def cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trtinfer", *map(str, args)], check=False, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.getcwd(), **(env or {})})


def greedy(engine: Path) -> list[list[int]]:
    with trtinfer.load(engine) as eng:
        return [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]


@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory):
    """export -> optimize -> build through the CLI, one stage directory feeding the next."""
    root = tmp_path_factory.mktemp("chain")
    src = tiny_model_dir("llama")
    runs = [cli("export", src, "-o", root / "exp"),
            cli("optimize", root / "exp", "-o", root / "opt", "--target", "onnxruntime-cpu"),
            cli("build", root / "opt", "-o", root / "eng", "--max-batch-size", "4")]
    for p in runs:
        assert p.returncode == 0, p.stderr
    return root, src, runs


def test_each_stage_directory_carries_what_the_next_needs(chain):
    root, _, _ = chain
    exp, opt = read_stage(root / "exp"), read_stage(root / "opt")
    assert exp.stage == "export" and opt.stage == "optimize"
    for name in ("tokenizer.json", "reference.npz", "chat_template.jinja"):
        assert name in exp.info["files"] and name in opt.info["files"]
    # model facts are written once by the export and carried unchanged
    for key in ("architecture", "model_type", "source", "geometry", "tokenizer"):
        assert opt.info[key] == exp.info[key]
    assert opt.validation == exp.validation and opt.validation["passed"]
    assert exp.kv_layout == "concat" and opt.kv_layout == "shared_buffer"
    assert "seqlens_k" in opt.io.input_names
    assert opt.history["optimize"]["config"]["target"] == "onnxruntime-cpu"
    m = json.loads((root / "eng" / "manifest.json").read_text())
    assert m["kv_layout"] == opt.kv_layout and m["geometry"] == exp.geometry
    assert m["export"]["validation"] == exp.validation and m["engine_check"]["passed"]
    assert list(m["stages"]) == ["compile + check"]  # export and optimize came from the inputs


def test_composed_engine_equals_one_command_build(chain, tmp_path):
    root, src, _ = chain
    direct = build(src, tmp_path / "direct", BuildConfig(max_batch_size=4), progress=False)
    assert greedy(root / "eng") == greedy(direct)
    from_export = build(root / "exp", tmp_path / "from_export", BuildConfig(max_batch_size=4), progress=False)
    assert greedy(from_export) == greedy(direct)
    a = json.loads((root / "eng" / "manifest.json").read_text())
    b = json.loads((direct / "manifest.json").read_text())
    for key in ("geometry", "io", "kv_layout", "fused_ops", "op_histogram", "engine_check", "tokenizer"):
        assert a[key] == b[key], key


def test_stage_mismatches_are_one_line_errors(chain, tmp_path):
    root, _, _ = chain
    p = cli("build", root / "opt", "-o", tmp_path / "x", "--precision", "fp16")
    assert p.returncode == 2 and "fp32 graph" in p.stderr and "Traceback" not in p.stderr
    p = cli("build", root / "opt", "-o", tmp_path / "x", "--target", "cuda")
    assert p.returncode == 2 and "optimized for onnxruntime-cpu" in p.stderr
    p = cli("optimize", root / "opt", "-o", tmp_path / "y")
    assert p.returncode == 2 and "already optimized" in p.stderr
    p = cli("build", root / "opt", "-o", tmp_path / "x", "--max-seq-len", "100000")
    assert p.returncode == 2 and "--max-seq-len" in p.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_settings_a_stage_input_would_ignore_are_refused(chain, tmp_path):
    """From an optimize or quantize stage, --disable-pass and quantization flags were dropped silently, and the
    manifest's build_config recorded the ignored settings (block_size 64 over weights quantized in blocks of 32)."""
    root, _, _ = chain
    p = cli("build", root / "opt", "-o", tmp_path / "x", "--disable-pass", "rotary")
    assert p.returncode == 2 and "was optimized with disable passes []" in p.stderr, p.stderr
    q = cli("quantize", root / "opt", "-o", tmp_path / "q", "--precision", "int4", "--method", "rtn")
    assert q.returncode == 0, q.stderr
    p = cli("build", tmp_path / "q", "-o", tmp_path / "x", "--precision", "int4", "--block-size", "64")
    assert p.returncode == 2 and "was quantized with block_size=None" in p.stderr and "block_size=64" in p.stderr
    assert not (tmp_path / "x").exists()
    p = cli("build", tmp_path / "q", "-o", tmp_path / "e", "--precision", "int4", "--max-batch-size", "4")
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert m["build_config"]["quantization"] == m["quantization"]["config"]
    assert m["build_config"]["quantization"]["method"] == "rtn"  # the stage's, not the default (gptq)


def test_an_output_that_is_its_input_is_refused(chain, tmp_path):
    """-o naming the input (or a folder holding it) with --force replaced the input: optimize ex -o ex --force left no
    export; now refused before any work, the input as it was. Inside the input is allowed (it replaces nothing)."""
    import shutil

    from trtinfer.errors import OutputError

    root, _, _ = chain
    exp = shutil.copytree(root / "exp", tmp_path / "exp")
    before = sorted(p.name for p in exp.iterdir())
    for out in (exp, tmp_path):
        with pytest.raises(OutputError, match=f"the output {out} (is|holds) the input {exp}"):
            optimize_stage(exp, out, overwrite=True)
    p = cli("build", exp, "-o", exp, "--force")
    assert p.returncode == 2 and "is the input" in p.stderr and "Traceback" not in p.stderr
    assert sorted(p.name for p in exp.iterdir()) == before and read_stage(exp).stage == "export"
    assert optimize_stage(exp, exp / "opt").stage == "optimize"


def test_max_seq_len_within_the_model_and_the_check(tiny_model_dir, tmp_path):
    """--max-seq-len past a learned position table (GPT-2's), or too short for the engine check's sequences (ONNX
    Runtime's attention refused them mid-check: 'internal error', exit 1), is one line naming the bound. (Past a
    rotary model's positions is a warning: tests/serving/test_tools.py builds such an engine and runs long prompts.)"""
    gpt2 = tiny_model_dir("gpt2")
    positions = json.loads((gpt2 / "config.json").read_text())["n_positions"]
    with pytest.raises(ConfigError, match=f"exceeds the model's {positions} learned positions"):
        build(gpt2, tmp_path / "a", BuildConfig(max_seq_len=positions + 1), progress=False)
    src = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="shorter than the engine check's sequences .* use at least"):
        build(src, tmp_path / "b", BuildConfig(max_seq_len=3), progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_modified_stage_directory_is_refused(chain, tmp_path):
    import shutil

    root, _, _ = chain
    exp = tmp_path / "exp"
    shutil.copytree(root / "exp", exp)
    data = exp / "model.onnx"  # the graph (its weights stay in the checkpoint: see the next test)
    raw = bytearray(data.read_bytes())
    raw[1000:1400] = np.random.default_rng(1).standard_normal(100).astype(np.float32).tobytes()
    data.write_bytes(bytes(raw))
    with pytest.raises(ModelSourceError, match="modified after `trtinfer export`"):
        build(exp, tmp_path / "eng", progress=False)
    p = cli("optimize", exp, "-o", tmp_path / "opt")
    assert p.returncode == 2 and "model.onnx" in p.stderr and "trtinfer export" in p.stderr
    assert not (tmp_path / "eng").exists() and not (tmp_path / "opt").exists()


def test_rebuild_reuses_every_stage(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    src = tiny_model_dir("qwen2")
    first = build(src, tmp_path / "a", progress=False)
    second = build(src, tmp_path / "b", progress=False)
    m1 = json.loads((first / "manifest.json").read_text())
    m2 = json.loads((second / "manifest.json").read_text())
    assert not any(r["cached"] for r in m1["stages"].values() if "cached" in r)
    assert [n for n, r in m2["stages"].items() if r.get("cached")] == ["export", "optimize"]  # the engine is made again
    assert m2["engine_check"] == m1["engine_check"] and m2["export"] == m1["export"]
    assert greedy(first) == greedy(second)
    # a different pass config is a different optimize entry; the export is still reused
    third = build(src, tmp_path / "c", BuildConfig(disable_passes=("gelu",)), progress=False)
    m3 = json.loads((third / "manifest.json").read_text())
    assert [n for n, r in m3["stages"].items() if r.get("cached")] == ["export"]


def test_checkpoint_changed_after_the_export_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    """An export reads its weights from the checkpoint it was made from: a shard rewritten since (other weights, same
    size) is one clear error, never an engine built from other numbers; nothing is written."""
    import shutil

    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), src)
    exp = export(src, tmp_path / "exp", ExportConfig(validate=False))
    shard = src / "model.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-4000:] = np.random.default_rng(2).standard_normal(1000).astype(np.float32).tobytes()
    shard.write_bytes(bytes(raw))
    with pytest.raises(ModelSourceError, match="model.safetensors changed after the export; export the model again"):
        build(exp.path, tmp_path / "eng", progress=False)
    p = cli("optimize", exp.path, "-o", tmp_path / "opt", env={"TRTINFER_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 2 and "changed after the export" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "eng").exists() and not (tmp_path / "opt").exists()
    shard.unlink()
    with pytest.raises(ModelSourceError, match="cannot be read now .*; export the model again"):
        build(exp.path, tmp_path / "eng", progress=False)


def test_cached_stage_of_a_rewritten_checkpoint_is_made_again(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """A model folder written again with the same weights (a fresh copy, a re-download): the cached export and
    optimize stages refer to the old files' stamps; a later build of the folder treats them as stale and makes them
    again (it once failed with "changed after the export")."""
    import shutil

    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), src)
    good = greedy(build(src, tmp_path / "a", progress=False))
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes())  # same bytes, new mtime
    with caplog.at_level("WARNING"):
        engine = build(src, tmp_path / "b", progress=False)
    stale = [r.getMessage() for r in caplog.records if "is stale" in r.getMessage()]
    assert stale and "model.safetensors changed after the export" in stale[0]
    m = json.loads((engine / "manifest.json").read_text())
    assert not m["stages"]["export"]["cached"] and not m["stages"]["optimize"]["cached"]
    assert greedy(engine) == good


def _cached_weights(cache: Path) -> Path:
    """The quantized weights in the cache (the export and optimize entries hold none: they read the checkpoint)."""
    [data] = list((cache / "quantized").glob("*/model.onnx.data"))
    return data


@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_damaged_cache_entry_is_rebuilt_not_trusted(damage, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """The observed failure: 50 MB of a cached export overwritten with other valid floats gave a broken engine and a
    success message; a truncated one broke every later build. Both are now detected, warned about and rebuilt (here
    on the quantized weights, the one cache entry that holds any)."""
    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    src = tiny_model_dir("llama")
    int8 = BuildConfig(precision="int8")
    good = greedy(build(src, tmp_path / "a", int8, progress=False))
    data = _cached_weights(tmp_path / "cache")
    raw = bytearray(data.read_bytes())
    if damage == "overwrite":  # same size, other plausible weights
        n = len(raw) // 2 // 4
        raw[:4 * n] = np.random.default_rng(0).standard_normal(n).astype(np.float32).tobytes()
    else:
        del raw[len(raw) // 3:]
    data.write_bytes(bytes(raw))
    with caplog.at_level("WARNING"):
        engine = build(src, tmp_path / "b", int8, progress=False)
    assert any("damaged" in r.getMessage() for r in caplog.records)
    m = json.loads((engine / "manifest.json").read_text())
    assert m["stages"]["export"]["cached"] and not m["stages"]["quantize"]["cached"]  # made again from the export
    assert m["export"]["validation"]["passed"] and m["engine_check"]["passed"]
    assert greedy(engine) == good


def test_no_reference_means_no_check_but_a_warning(tiny_model_dir, tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    exp = export(tiny_model_dir("llama"), tmp_path / "exp", ExportConfig(logits="all"))
    assert exp.reference_path is None
    opt = optimize_stage(exp, tmp_path / "opt", PassConfig(max_seq_len=64))
    assert opt.stage == "optimize"
    with pytest.raises(ConfigError, match="already optimized"):
        optimize_stage(opt, tmp_path / "opt2", PassConfig(max_seq_len=64))
    for out in ("eng", "eng2"):  # the second build reuses the compiled entry and still says it is unchecked
        caplog.clear()
        with caplog.at_level("WARNING"):
            engine = build(opt.path, tmp_path / out, progress=False)
        assert any("not compared with the fp32 graph" in r.getMessage() for r in caplog.records)
        assert "engine_check" not in json.loads((engine / "manifest.json").read_text())


def test_optimize_stage_pass_settings_are_recorded(chain, tmp_path):
    root, _, _ = chain
    opt = optimize_stage(root / "exp", tmp_path / "opt", PassConfig(max_seq_len=128, disable=("skip_norm",)))
    m = json.loads((build(opt.path, tmp_path / "eng", progress=False) / "manifest.json").read_text())
    assert m["build_config"]["disable_passes"] == ["skip_norm"] and m["limits"]["max_seq_len"] == 128
    assert "SkipSimplifiedLayerNormalization" not in m["op_histogram"]


def test_existing_output_is_refused_before_the_work(chain, tmp_path):
    root, src, _ = chain
    (tmp_path / "taken").mkdir()
    for args in (("export", src), ("optimize", root / "exp")):
        p = cli(*args, "-o", tmp_path / "taken")
        assert p.returncode == 2 and "already exists" in p.stderr and "internal error" not in p.stderr
        assert "--force" in p.stderr


def test_engine_directory_modes_follow_the_umask(tiny_model_dir, tmp_path):
    code = ("import os, sys; os.umask(0o022); from trtinfer.builder import build; "
            f"build({str(tiny_model_dir('gpt2'))!r}, {str(tmp_path / 'eng')!r}, progress=False)")
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "eng").stat().st_mode & 0o777 == 0o755
    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "eng").iterdir()} == {0o644}


def test_build_output_is_quiet_and_truthful(tiny_model_dir, tmp_path):
    p = cli("build", tiny_model_dir("gemma3"), "-o", tmp_path / "eng", env={"TRTINFER_CACHE": str(tmp_path / "c")})
    assert p.returncode == 0, p.stderr
    assert len([ln for ln in p.stdout.splitlines() if " in " in ln and ln.startswith("built ")]) == 1
    assert "Report(" not in p.stderr and "Check(" not in p.stderr  # no dataclass reprs
    assert "it/s" not in p.stderr and "%|" not in p.stderr  # no third-party progress bars
    assert not [ln for ln in p.stderr.splitlines() if ln.startswith(("INFO", "DEBUG"))]
    assert "gelu 3/3" in p.stdout and "KV layout shared_buffer" in p.stdout
