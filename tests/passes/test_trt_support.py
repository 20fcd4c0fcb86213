"""TensorRT op support: the op counter on hand-written graphs, the check pass, and tiny exports built for TensorRT."""
from __future__ import annotations

import onnx.parser
import onnx_ir as ir
import pytest

from trtinfer.errors import BuildError
from trtinfer.passes import PassConfig, PassContext
from trtinfer.passes.trt_support import TENSORRT_ONNX_OPS, tensorrt_check, unsupported_ops

from ._fusion_checks import ORT, TRT, export_once, run_passes

# an ORT-fused norm next to an op TensorRT lacks, one of them inside an If branch (5 nodes in all)
MIXED = """
<ir_version: 10, opset_import: ["" : {OPSET}, "com.microsoft" : 1]>
g (float[B,S,8] x, float[B,S,8] res, bool c) => (float[B,S,8] y, float[N] u)
<float[8] w = {1, 1, 1, 1, 1, 1, 1, 1}>
{
  y, mean, inv, h = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 1e-6> (x, res, w)
  u = If (c) <
    then_branch = t () => (float[N] ut) { ut = Unique (x) },
    else_branch = e () => (float[N] ue) { f = Flatten <axis = 0> (x)  ue = Unique (f) }
  >
}
"""
PLAIN = """
<ir_version: 10, opset_import: ["" : {OPSET}]>
g (float[B,S,8] x) => (float[B,S,8] y)
{
  s = Sigmoid(x)
  y = Mul(x, s)
}
"""


def _model(text: str, opset: int = 17) -> ir.Model:
    return ir.from_proto(onnx.parser.parse_model(text.replace("{OPSET}", str(opset))))


def test_unsupported_ops_counts_contrib_and_missing_ops_in_subgraphs() -> None:
    assert unsupported_ops(_model(MIXED)) == {"Unique": 2, "com.microsoft::SkipSimplifiedLayerNormalization": 1}


def test_unsupported_ops_empty_for_standard_graph() -> None:
    assert unsupported_ops(_model(PLAIN)) == {}


def test_op_list_has_what_the_passes_emit_for_tensorrt() -> None:
    assert {"RMSNormalization", "LayerNormalization", "Gelu", "MatMul", "Softmax"} <= TENSORRT_ONNX_OPS
    assert not {"SimplifiedLayerNormalization", "Unique", "FastGelu"} & TENSORRT_ONNX_OPS


def test_check_names_every_unsupported_op() -> None:
    with pytest.raises(BuildError, match=r"Unique x2, com.microsoft::SkipSimplifiedLayerNormalization x1"):
        tensorrt_check(_model(MIXED), PassContext(PassConfig(target=TRT), {}))


def test_check_rejects_opset_outside_tensorrt_range() -> None:
    with pytest.raises(BuildError, match="default opset 8"):
        tensorrt_check(_model(PLAIN, opset=8), PassContext(PassConfig(target=TRT), {}))


def test_check_passes_standard_graph_and_ignores_ort_targets() -> None:
    assert tensorrt_check(_model(PLAIN), PassContext(PassConfig(target=TRT), {})) == 0
    assert tensorrt_check(_model(MIXED), PassContext(PassConfig(target=ORT), {})) == 0


# --- tiny exports ---------------------------------------------------------------------------------------------------

CHAIN = ("rms_norm", "layer_norm", "skip_norm", "gelu", "matmul_bias")


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    """``exports(arch)`` -> the tiny model's exported ``model.onnx`` (once per session)."""
    return lambda arch: export_once(arch, tiny_model_dir, tmp_path_factory)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_export_for_tensorrt_is_all_supported(arch: str, exports) -> None:
    model, counts = run_passes(exports(arch), TRT, (*CHAIN, "tensorrt_check"))
    assert counts["tensorrt_check"] == (0, None)
    assert unsupported_ops(model) == {}
    assert not any(n.domain == "com.microsoft" for n in model.graph)
    assert "com.microsoft" not in model.opset_imports


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_export_fused_for_ort_fails_the_check(arch: str, exports) -> None:
    model, _ = run_passes(exports(arch), ORT, CHAIN)
    with pytest.raises(BuildError, match="com.microsoft::Skip"):
        tensorrt_check(model, PassContext(PassConfig(target=TRT), {}))
