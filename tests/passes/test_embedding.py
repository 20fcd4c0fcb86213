"""A tied embedding is stored once in the engine: the token embedding reads the LM head's weight (Gather on axis 1 +
Transpose); engines of tied tiny models keep their eager tokens; untied models and quantized engines are untouched."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from tiny_models import VOCAB
from transformers import AutoTokenizer

import trtinfer
from tests.runtime.test_generation import hf_greedy
from trtinfer.passes.embedding import share_tied_embedding

HIDDEN = 64  # tiny_models' hidden size


def _tables(engine) -> list[tuple[str, list[int], int]]:
    """(name, dims, element type) of every initializer holding a [V, H] or [H, V] matrix."""
    m = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    return [(t.name, list(t.dims), t.data_type) for t in m.graph.initializer
            if sorted(t.dims) == sorted([VOCAB, HIDDEN])]


def _gathers(engine) -> list[int]:
    m = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    return [next((a.i for a in n.attribute if a.name == "axis"), 0) for n in m.graph.node if n.op_type == "Gather"
            and any(i in {t.name for t in m.graph.initializer if sorted(t.dims) == sorted([VOCAB, HIDDEN])}
                    for i in n.input)]


@pytest.mark.parametrize("arch", ["gemma3", "gpt2"])
def test_tied_embedding_stored_once_and_tokens_unchanged(arch, tiny_model_dir, tiny_engine):
    engine = tiny_engine(arch)
    tables = _tables(engine)
    assert [dims for _, dims, _ in tables] == [[HIDDEN, VOCAB]]  # the head's E^T only
    assert _gathers(engine) == [1]  # the embedding reads it along axis 1
    src = tiny_model_dir(arch)
    ids = AutoTokenizer.from_pretrained(src)("The history of the city").input_ids
    with trtinfer.load(engine) as eng:
        out = eng.generate(input_ids=[ids], max_new_tokens=8, ignore_eos=True)[0]
    assert out.token_ids == hf_greedy(src, ids, 8, eos_token_id=None, min_new_tokens=8)


def test_untied_embedding_keeps_both(tiny_engine):
    tables = _tables(tiny_engine("llama"))
    assert sorted(dims for _, dims, _ in tables) == [[HIDDEN, VOCAB], [VOCAB, HIDDEN]]
    assert _gathers(tiny_engine("llama")) == [0]


def test_disabling_the_pass_keeps_both_tables(tiny_engine):
    tables = _tables(tiny_engine("gemma3", disable_passes=("tied_embedding",)))
    assert sorted(dims for _, dims, _ in tables) == [[HIDDEN, VOCAB], [VOCAB, HIDDEN]]


def test_fp16_engine_stores_the_tied_table_once(tiny_engine):
    tables = _tables(tiny_engine("gemma3", precision="fp16"))
    assert [(dims, dtype) for _, dims, dtype in tables] == [([HIDDEN, VOCAB], onnx.TensorProto.FLOAT16)]


def test_int4_engine_shares_its_packed_head(tiny_engine):
    """Quantizers tie their own way (GatherBlockQuantized on the head's packed codes): no float table is left."""
    engine = tiny_engine("gemma3", precision="int4")
    assert _tables(engine) == []
    m = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in m.graph.node}
    assert "GatherBlockQuantized" in ops and "MatMulNBits" in ops


def _head_graph(tied: bool) -> tuple[ir.Model, np.ndarray, np.ndarray]:
    """ids -> Gather(E) -> MatMul(W) -> logits, with W = E^T when ``tied``."""
    rng = np.random.default_rng(0)
    e = rng.standard_normal((11, 4)).astype(np.float32)
    w = e.T.copy() if tied else rng.standard_normal((4, 11)).astype(np.float32)
    ids = ir.Value(name="input_ids", shape=ir.Shape([2, 3]), type=ir.TensorType(ir.DataType.INT64))
    table = ir.Value(name="E", shape=ir.Shape([11, 4]), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=ir.Tensor(e, name="E"))
    head = ir.Value(name="W", shape=ir.Shape([4, 11]), type=ir.TensorType(ir.DataType.FLOAT),
                    const_value=ir.Tensor(w, name="W"))
    gather = ir.node("Gather", [table, ids], name="embed")
    gather.outputs[0].name, gather.outputs[0].shape = "emb", ir.Shape([2, 3, 4])
    gather.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    mm = ir.node("MatMul", [gather.outputs[0], head], name="lm_head")
    mm.outputs[0].name, mm.outputs[0].shape = "logits", ir.Shape([2, 3, 11])
    mm.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([ids], [mm.outputs[0], gather.outputs[0]], nodes=[gather, mm], initializers=[table, head],
                     opset_imports={"": 17})
    return ir.Model(graph, ir_version=9), e, w


def _run(model: ir.Model, ids: np.ndarray) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids})


def test_rewrite_computes_the_same_and_drops_the_table():
    model, e, _ = _head_graph(tied=True)
    ids = np.array([[0, 3, 10], [7, 7, 1]], dtype=np.int64)
    before = _run(model, ids)
    assert share_tied_embedding(model, vocab_size=11)
    assert set(model.graph.initializers) == {"W"}
    after = _run(model, ids)
    np.testing.assert_array_equal(after[1], e[ids])  # the embedding, read from W along axis 1
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_rewrite_leaves_an_untied_pair():
    model, _, _ = _head_graph(tied=False)
    assert not share_tied_embedding(model, vocab_size=11)
    assert set(model.graph.initializers) == {"E", "W"}
