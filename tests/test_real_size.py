"""benchmarks/real_size.py: ``/usr/bin/time -v`` parsing, a failed build as a row, the skipped-validation reason
from the cache, and (slow) the whole run on a one-layer real-width slice, cleaned up after itself."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

TIME_REPORT = """\tCommand being timed: "python -m trtinfer build x"
\tElapsed (wall clock) time (h:mm:ss or m:ss): {wall}
\tMaximum resident set size (kbytes): 1429036
\tExit status: {rc}
"""


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("real_size", ROOT / "benchmarks" / "real_size.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_size"] = module
    spec.loader.exec_module(module)
    return module


real_size = _load_script()


def test_time_v_figures_and_the_programs_last_line():
    ok = real_size.parse_time_v("traced llama\nvalidated\n" + TIME_REPORT.format(wall="1:02:03.5", rc=0))
    assert ok["peak_rss_bytes"] == 1429036 * 1024 and ok["wall_s"] == pytest.approx(3723.5)
    assert ok["last_line"] == "validated" and ok["signal"] is None
    failed = real_size.parse_time_v("trtinfer build: error: out of disk\nCommand exited with non-zero status 1\n"
                                    + TIME_REPORT.format(wall="0:33.28", rc=1))
    assert failed["last_line"] == "trtinfer build: error: out of disk" and failed["wall_s"] == pytest.approx(33.28)
    # killed while it drew a progress bar: the kill is the error, not the bar
    killed = real_size.parse_time_v("Loading weights: 100%| 399/399\nCommand terminated by signal 9\n"
                                    + TIME_REPORT.format(wall="0:01.00", rc=0))
    assert killed["signal"] == "Command terminated by signal 9"
    assert killed["last_line"].startswith("Command terminated by signal 9 (SIGKILL") and "Loading" not in killed["last_line"]


def test_a_failed_build_is_a_row(tmp_path):
    engine = tmp_path / "engines" / "fp8"
    engine.parent.mkdir(parents=True)
    row = real_size.build_row(tmp_path, "fp8", None, engine, tmp_path / "cache")
    assert row["exit_code"] != 0 and "fp8" in row["error"] and row["build_peak_rss_bytes"] > 0
    assert row["command"][-4:] == ["fp8", "-o", str(engine), "--force"]
    assert real_size.check_text(row).startswith("build failed: ")


def test_precision_suffixes_become_build_flags(tmp_path):
    assert real_size.build_flags("int4") == []
    assert real_size.build_flags("int4+b128+prefill") == ["--block-size", "128", "--prefill", "int8"]
    with pytest.raises(ValueError, match=r"'\+b12x'"):
        real_size.build_flags("int4+b12x")
    with pytest.raises(SystemExit) as refused:  # refused before any checkpoint is written
        real_size.main(["--preset", "llama-3.2-1b", "--precisions", "int4,int4+fast", "--work", str(tmp_path)])
    assert refused.value.code == 2 and not any(tmp_path.iterdir())


def test_a_gguf_source_refuses_the_peers_that_need_a_folder(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    for flag in ("--oga-python", "--llama-cpp-convert"):
        with pytest.raises(SystemExit) as refused:  # refused before anything is probed, built or written
            real_size.main(["--gguf", str(gguf), flag, sys.executable, "--work", str(tmp_path / "w")])
        assert refused.value.code == 2 and "--gguf: llama.cpp runs the file itself" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_prompt_ids_are_the_benchmark_prompt(tmp_path, tiny_model_dir):
    from tokenizers import Tokenizer

    from trtinfer.bench import PROMPT_TEXT

    tok = tiny_model_dir("llama") / "tokenizer.json"
    ids = json.loads(real_size.prompt_ids(tok, 12, tmp_path / "ids.json").read_text())
    assert ids == Tokenizer.from_file(str(tok)).encode(PROMPT_TEXT).ids[:12] and len(ids) == 12


def test_main_on_a_one_layer_slice(tmp_path):
    try:
        report = real_size.main(["--preset", "llama-3.2-1b", "--layers", "1", "--vocab", "512", "--precisions",
                                 "int4", "--batch-sizes", "1,2", "--prompt-len", "16", "--batch-prompt-len", "8",
                                 "--new-tokens", "4", "--buffer-mib", "16", "--work", str(tmp_path),
                                 "--out", str(tmp_path / "r")])
        saved = json.loads((tmp_path / "r.json").read_text())
        assert (tmp_path / "r.png").stat().st_size > 0
        assert saved["rows"] == json.loads(json.dumps(report["rows"]))
        (row,) = saved["rows"]
        assert row["exit_code"] == 0 and "error" not in row and row["command"][-2:] == ["--method", "rtn"]
        assert row["engine_check"]["passed"] and row["accuracy_check"]["passed"] and row["export_validation"]
        assert row["cache_growth_bytes"] > row["engine_bytes"] > 0 and row["build_peak_rss_bytes"] > 0
        assert [r["batch_size"] for r in row["runs"]] == [1, 2]
        for run in row["runs"]:
            assert run["decode_tok_s"] > 0 and run["peak_rss_mib"] > 0 and run["ttft_ms"] > 0
            assert run["fraction_of_read"] == pytest.approx(run["achieved_gb_s"] / saved["ceiling_gb_s"]["read"])
            assert run["fraction_of_int4_kernel"] == pytest.approx(run["achieved_gb_s"] / saved["ceiling_gb_s"]["int4"])
        # the int4 ceiling is the best probe on huge pages (as engines run); on a 16 MiB buffer a 4 KiB-page probe
        # may come out faster by noise, and is recorded apart
        for kind, huge in (("int4", True), ("int4_4k", False)):
            assert saved["ceiling_gb_s"][kind] == max(p["gb_s"] for p in saved["int4_kernel_probes"]
                                                      if p["huge_pages"] is huge)
        assert not Path(saved["settings"]["run_dir"]).exists()  # engines, logs and the default cache are gone
        assert (tmp_path / "checkpoints" / "llama-3.2-1b-l1-v512" / "config.json").is_file()
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_tree_bytes_counts_a_link_to_the_source_once_and_can_leave_it_out(tmp_path):
    import os

    src = tmp_path / "m.gguf"
    src.write_bytes(b"x" * 65536)
    cache = tmp_path / "cache"
    cache.mkdir()
    os.link(src, cache / "model.gguf")  # as a converted GGUF's folder links to it
    (cache / "stage.bin").write_bytes(b"y" * 8192)
    whole = real_size.tree_bytes(cache)
    assert whole >= 65536 + 8192
    assert real_size.tree_bytes(cache, exclude=src) == whole - src.stat().st_blocks * 512
    assert real_size.tree_bytes(cache / "model.gguf", exclude=src) == 0
