"""benchmarks/vs_peers.py and its peer workers, on what runs without the peers' venvs: the measuring rule on a
generator with known timings, the one-line refusal of a bad interpreter, and the made-once peer model folders."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


timing = _load(ROOT / "benchmarks" / "peer_workers" / "_timing.py", "peer_timing")


def test_measuring_rule_on_known_timings():
    calls: list[int] = []
    firsts = iter([0.30, 0.25, 0.40])  # time to the first token in the three long calls

    def gen(n: int):
        calls.append(n)
        if n == 1:  # one-token calls: 0.2 s, 0.1 s, 0.3 s, ...
            return 0.5, [0.2, 0.1, 0.3, 0.15, 0.25][sum(c == 1 for c in calls) - 1], [7]
        if n == 4:
            return 0.0, 1.0, [7, 8, 9, 10]
        f = next(firsts)
        return f, f + 1.0 + (0.5 if f == 0.40 else 0.0), list(range(64))

    a = argparse.Namespace(bs=2, new_tokens=64, repeats=5, prompt=[1] * 128)
    r = timing.measure("peer", "1.0", a, gen, threads=2)
    assert calls == [4, 1, 1, 1, 1, 1, 64, 64, 64]
    assert r["ttft_ms"] == pytest.approx(100.0)  # best one-token call
    assert r["decode_tok_s"] == pytest.approx(2 * 63 / 1.0)  # best run: 63 tokens per row in 1 s after the first
    assert r["first_tokens"] == list(range(8)) and r["prompt_len"] == 128 and r["threads"] == 2


def test_measuring_rule_without_first_token_times():
    def gen(n: int):  # a peer that cannot tell its first token: the median one-token call stands in
        return None, {1: 0.2, 4: 0.5}.get(n, 2.2), [3] * n

    a = argparse.Namespace(bs=1, new_tokens=64, repeats=3, prompt=[1] * 16)
    assert timing.measure("peer", "1.0", a, gen)["decode_tok_s"] == pytest.approx(63 / 2.0)


def test_bad_interpreter_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vs_peers", "--oga-python",
                           str(tmp_path / "nope" / "python"), "--out", str(tmp_path / "r.json")],
                          check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    want = (f"--oga-python {tmp_path / 'nope' / 'python'}: not an executable interpreter; make the venvs with "
            "benchmarks/peer_workers/setup.sh or leave the flag out")
    assert proc.stderr.strip().splitlines() == [want]
    assert not (tmp_path / "r.json").exists()


def test_peer_models_are_made_once_and_never_half(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path))
    vs = _load(ROOT / "benchmarks" / "vs_peers.py", "vs_peers")
    out = vs.peer_cache() / "thing"

    def broken(tmp: Path) -> None:
        (tmp / "half.onnx").write_text("x")
        raise RuntimeError("builder failed")

    with pytest.raises(RuntimeError, match="builder failed"):
        vs._made_once(out, broken)
    assert not out.exists() and list(out.parent.iterdir()) == []  # nothing left behind
    made = []
    assert vs._made_once(out, lambda tmp: (tmp / "model.onnx").write_text("m") and made.append(1)) == out
    assert vs._made_once(out, lambda tmp: made.append(2)) == out  # the second call reuses it
    assert made == [1] and (out / "model.onnx").read_text() == "m"
