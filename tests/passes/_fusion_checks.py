"""Shared checks of the fusion tests: run a pass on a text graph, compare fused vs unfused, cached tiny exports."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator
from tiny_models import whole_file

# importing a pass module registers its passes (pipelines.py imports those it lists)
import trtinfer.passes.activations
import trtinfer.passes.norms
import trtinfer.passes.trt_support  # noqa: F401
from trtinfer.passes import PassConfig, PassContext
from trtinfer.passes.registry import get_pass

ORT = "onnxruntime-cpu"
TRT = "tensorrt"
PassFn = Callable[[ir.Model, PassContext], int]


def fill(template: str, **slots: Any) -> str:
    """``template`` with ``{SLOT}`` replaced by ``slots`` and ``{{``/``}}`` unescaped (f-string style)."""
    out = template
    for k, v in slots.items():
        out = out.replace("{" + k + "}", str(v))
    return out.replace("{{", "{").replace("}}", "}")


def floats(n: int, seed: int, scale: float = 0.3, offset: float = 0.0) -> str:
    """``n`` random floats as a text-format tensor literal ``{a, b, ...}``."""
    vals = np.random.default_rng(seed).standard_normal(n) * scale + offset
    return "{" + ", ".join(f"{v:.6f}" for v in vals) + "}"


def apply_pass(text: str, fn: PassFn, target: str,
               geometry: dict[str, Any] | None = None) -> tuple[onnx.ModelProto, onnx.ModelProto, int]:
    """Run pass ``fn`` on the text graph (shapes inferred first, as cleanup leaves them).

    Returns the unfused proto, the fused proto (dead nodes dropped) and how many times ``fn`` fired.
    """
    before = onnx.parser.parse_model(text)
    onnx.checker.check_model(before)
    model = ir.from_proto(before)
    common_passes.ShapeInferencePass(strict_mode=False)(model)
    fired = fn(model, PassContext(PassConfig(target=target), dict(geometry or {})))
    common_passes.RemoveUnusedNodesPass()(model)
    return before, ir.to_proto(model), fired


def op_types(proto: onnx.ModelProto) -> list[str]:
    """The graph's op types in order."""
    return [n.op_type for n in proto.graph.node]


def run_ort(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run on ORT's CPU provider with its own graph optimizations off (so our ops are what runs)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _reference(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    # onnx's evaluator where it knows every op; graphs that already hold com.microsoft ops go to ORT
    if all(n.domain in ("", "ai.onnx") for n in proto.graph.node):
        return list(ReferenceEvaluator(proto).run(None, feeds))
    return run_ort(proto, feeds)


def assert_same(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray],
                atol: float = 1e-5) -> None:
    """The fused graph (on ORT) computes every output the unfused one does."""
    ref, got = _reference(before, feeds), run_ort(after, feeds)
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, atol=atol, rtol=1e-5)


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    """Standard-normal float32 times 3 (GELU's tails and the norms' scale both get exercised)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3


# --- tiny exports ---------------------------------------------------------------------------------------------------

_EXPORTS: dict[str, Path] = {}  # one export per arch for the whole session, shared by the pass test modules


def export_once(arch: str, tiny_model_dir: Callable[[str], Path], tmp_path_factory: Any) -> Path:
    """``model.onnx`` of the tiny ``arch`` model (exported without validation: the export tests validate)."""
    if arch not in _EXPORTS:
        from trtinfer.export import ExportConfig
        from trtinfer.export.onnx_export import export

        out = tmp_path_factory.mktemp(f"fusion-{arch}") / "x"
        _EXPORTS[arch] = whole_file(export(tiny_model_dir(arch), out, ExportConfig(validate=False)).onnx_path)
    return _EXPORTS[arch]


def run_passes(path: Path, target: str, names: tuple[str, ...], geometry: dict[str, Any] | None = None,
               ) -> tuple[ir.Model, dict[str, tuple[int, int | None]]]:
    """Load, ``cleanup``, run ``names`` in order, ``dead_code``; the model and ``{name: (fired, expected)}``."""
    model = ir.load(str(path))
    ctx = PassContext.for_model(model, PassConfig(target=target), geometry)
    get_pass("cleanup").fn(model, ctx)
    counts = {}
    for name in names:
        spec = get_pass(name)
        counts[name] = (spec.fn(model, ctx), spec.expected(ctx) if spec.expected else None)
    get_pass("dead_code").fn(model, ctx)
    ir.external_data.load_to_model(model)  # weights inline, so the proto runs from bytes
    return model, counts


def decoder_feeds(sess: ort.InferenceSession, batch: int = 2, seq: int = 5, past: int = 3) -> dict[str, np.ndarray]:
    """A random prompt continuing a random past of ``past`` positions."""
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 300, (batch, seq)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, past + seq), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(past, past + seq), (batch, 1)).astype(np.int64)
        else:
            feeds[i.name] = rng.standard_normal((batch, i.shape[1], past, i.shape[3])).astype(np.float32)
    return feeds


def assert_matches_export(path: Path, model: ir.Model, atol: float = 1e-4) -> None:
    """ORT on the fused model == ORT on the exported one, for the logits and every present K/V."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref_sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = decoder_feeds(ref_sess)
    ref = ref_sess.run(None, feeds)
    got = ort.InferenceSession(ir.to_proto(model).SerializeToString(), so,
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, atol=atol)
