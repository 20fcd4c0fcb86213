"""runtime.memory: what is available, what a graph's weights take, and when sessions read weights in place."""
from __future__ import annotations

import onnxruntime as ort

from trtinfer.runtime.memory import available_memory, lean_weights, prepacks, weight_bytes


def test_available_memory_and_weight_bytes(tmp_path):
    avail = available_memory()
    assert avail is not None and avail > 2**26  # /proc/meminfo on Linux: more than 64 MiB free
    (tmp_path / "model.onnx").write_bytes(b"x" * 100)
    (tmp_path / "model.onnx.data").write_bytes(b"y" * 1000)
    (tmp_path / "other.txt").write_bytes(b"z" * 10)
    assert weight_bytes(tmp_path / "model.onnx") == 1100


def test_lean_only_for_big_weights_or_when_asked(tmp_path):
    small = tmp_path / "model.onnx"
    small.write_bytes(b"x" * 100)
    so = ort.SessionOptions()
    assert not lean_weights(so, small)
    assert prepacks(so)
    so = ort.SessionOptions()
    assert lean_weights(so, small, always=True) and not prepacks(so)
    # a sparse file larger than half the available memory: no prepacked copy (0.95 of it: the suite's other worker
    # may free memory between this reading and lean_weights' own)
    big = tmp_path / "big" / "model.onnx"
    big.parent.mkdir()
    big.write_bytes(b"x")
    with open(big.parent / "model.onnx.data", "wb") as f:
        f.truncate(int(available_memory() * 0.95))
    so = ort.SessionOptions()
    assert lean_weights(so, big) and not prepacks(so)
