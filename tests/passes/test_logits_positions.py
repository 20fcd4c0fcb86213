"""logits_positions: the last-token Slice before the LM head -> a gather at the positions the runtime asks for."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx.reference import ReferenceEvaluator

from trtinfer.passes import PassConfig, PassContext
from trtinfer.passes.layout import LOGITS_POSITIONS, logits_positions

from ._fusion_checks import ORT, TRT, apply_pass, fill, floats, op_types, run_ort

V, D = 7, 4
INT64_MAX = 2**63 - 1
# embeddings -> a layer -> hidden[:, -1:] -> LM head, as logits_to_keep=1 traces it (4 nodes)
GRAPH = """
<ir_version: 9, opset_import: ["" : 17]>
lm (int64[B,S] input_ids, float[B,2,P,2] past_key_values_0_key) => (float[B,1,{V}] logits)
<float[{V},{D}] emb = {EMB}, float[{D},{V}] head = {HEAD}, int64[1] starts = {{{START}}},
 int64[1] ends = {{{END}}}, int64[1] axes = {{1}}>
{{
  h = Gather (emb, input_ids)
  t = Tanh (h)
  last = Slice (t, starts, ends, axes)
  logits = MatMul (last, head)
}}
"""
EMB, HEAD = floats(V * D, 0, scale=1.0), floats(D * V, 1, scale=1.0)


def _text(start: int = -1, end: int = INT64_MAX) -> str:
    return fill(GRAPH, V=V, D=D, EMB=EMB, HEAD=HEAD, START=start, END=end)


def _eager(ids: np.ndarray) -> np.ndarray:
    """Every position's logits, computed in numpy: tanh(emb[ids]) @ head."""
    emb = np.array([float(x) for x in EMB.strip("{}").split(",")], np.float32).reshape(V, D)
    head = np.array([float(x) for x in HEAD.strip("{}").split(",")], np.float32).reshape(D, V)
    return np.tanh(emb[ids]) @ head  # type: ignore[no-any-return]


@pytest.mark.parametrize("target", [ORT, TRT])
def test_last_token_slice_becomes_positions_gather(target: str) -> None:
    before, after, fired = apply_pass(_text(), logits_positions, target)
    assert fired == 1
    assert op_types(after) == ["Gather", "Tanh", "Constant", "Unsqueeze", "GatherND", "MatMul"]
    names = [i.name for i in after.graph.input]
    assert names == ["input_ids", LOGITS_POSITIONS, "past_key_values_0_key"]  # before the KV inputs
    pos = after.graph.input[1].type.tensor_type
    assert pos.elem_type == onnx.TensorProto.INT64 and [d.dim_param for d in pos.shape.dim] == ["B", "positions"]
    assert after.graph.output[0].type.tensor_type.shape.dim[1].dim_param == "positions"
    onnx.checker.check_model(after, full_check=True)

    ids = np.array([[1, 4, 2, 6, 3], [5, 0, 0, 2, 1]], np.int64)
    kv = np.zeros((2, 2, 0, 2), np.float32)
    ref = ReferenceEvaluator(before).run(None, {"input_ids": ids, "past_key_values_0_key": kv})[0]
    full = _eager(ids)
    np.testing.assert_allclose(ref[:, 0], full[:, -1], atol=1e-5)  # the test's own reference is right

    def run(positions: list[list[int]]) -> np.ndarray:
        feeds = {"input_ids": ids, LOGITS_POSITIONS: np.array(positions, np.int64), "past_key_values_0_key": kv}
        got = run_ort(after, feeds)[0]
        np.testing.assert_allclose(ReferenceEvaluator(after).run(None, feeds)[0], got, atol=1e-5)
        return got

    np.testing.assert_allclose(run([[4], [4]]), ref, atol=1e-5)  # the last position: what the Slice gave
    np.testing.assert_allclose(run([list(range(5))] * 2), full, atol=1e-5)  # every position (scoring)
    np.testing.assert_allclose(run([[2], [0]])[:, 0], full[[0, 1], [2, 0]], atol=1e-5)  # one per row (ragged)


@pytest.mark.parametrize(("start", "end"), [(0, INT64_MAX), (-2, INT64_MAX), (-1, 3)])
def test_other_slices_are_left_alone(start: int, end: int) -> None:
    """Not ``[:, -1:]`` along the sequence axis: not the LM head's last-token selection."""
    _, after, fired = apply_pass(_text(start, end), logits_positions, ORT)
    assert fired == 0 and "GatherND" not in op_types(after)
    assert LOGITS_POSITIONS not in [i.name for i in after.graph.input]


def test_runs_once() -> None:
    model = ir.from_proto(onnx.parser.parse_model(_text()))
    ctx = PassContext(PassConfig(target=ORT), {})
    assert logits_positions(model, ctx) == 1
    assert logits_positions(model, ctx) == 0  # the input is already there
    assert [v.name for v in model.graph.inputs].count(LOGITS_POSITIONS) == 1
