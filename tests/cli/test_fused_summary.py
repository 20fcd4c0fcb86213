"""`trtinfer build` and `trtinfer inspect` print one fused-ops line, read from the engine graph's op histogram."""
from __future__ import annotations

import pytest

from trtinfer.artifact import read_manifest
from trtinfer.builder.backends import FUSED_OPS
from trtinfer.cli import main
from trtinfer.cli.summary import fused_text


def _line(out: str, prefix: str) -> str:
    [line] = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    return line.removeprefix(prefix).strip()


@pytest.mark.parametrize("precision,gelu", [
    ("fp32", "gelu 3/3"),
    # ONNX Runtime's CPU provider has no fp16 FastGelu kernel: it inlines the op's body into the engine graph
    ("fp16", "gelu 0/3 (the passes fused 3; the backend expanded them again)"),
])
def test_build_and_inspect_agree_with_the_graph(precision, gelu, tiny_model_dir, tmp_path, capsys):
    engine = tmp_path / "engine"
    assert main(["-q", "build", str(tiny_model_dir("gemma3")), "-o", str(engine), "--precision", precision]) == 0
    built = _line(capsys.readouterr().out, "fused:")
    assert main(["inspect", str(engine)]) == 0
    assert _line(capsys.readouterr().out, "fused ops") == built
    assert gelu in built
    m = read_manifest(engine).raw
    in_graph = sum(n for op, n in m["op_histogram"].items() if op.split(".")[-1] in FUSED_OPS["gelu"])
    assert m["fused_ops"]["gelu"]["count"] == in_graph == (3 if precision == "fp32" else 0)
    assert m["fusion_report"]["fusions"]["gelu"]["fired"] == 3


def test_fused_text() -> None:
    fused = {"attention": {"count": 2, "expected": 2}, "norm": {"count": 5, "expected": None},
             "gelu": {"count": 0, "expected": 0}, "rotary": {"count": 0, "expected": None, "by_passes": 4}}
    assert fused_text(fused) == "attention 2/2, norm 5, rotary 0 (the passes fused 4; the backend expanded them again)"
