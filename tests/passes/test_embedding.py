"""A tied embedding is stored once in the engine: on the CPU (fp32) the head reads the embedding's table
(FusedMatMul transB) under a name of its own over the same bytes, elsewhere the embedding reads the head's weight
(Gather on axis 1 + Transpose); engines of tied tiny models keep their eager tokens; untied models and quantized
engines are untouched."""
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


def _tables(engine) -> list[tuple[str, list[int], int, tuple[str, str] | None]]:
    """(name, dims, element type, (file, offset) where stored outside the graph) of every initializer holding a
    [V, H] or [H, V] matrix."""
    m = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    out = []
    for t in m.graph.initializer:
        if sorted(t.dims) == sorted([VOCAB, HIDDEN]):
            where = {e.key: e.value for e in t.external_data}
            out.append((t.name, list(t.dims), t.data_type,
                        (where["location"], where.get("offset", "0")) if where else None))
    return out


def _stored(tables) -> list[tuple[list[int], int]]:
    """The distinct stored matrices among ``tables``: (dims, element type) once per stored region."""
    seen: dict[object, tuple[list[int], int]] = {}
    for name, dims, dtype, where in tables:
        seen.setdefault(where or name, (dims, dtype))
    return sorted(seen.values())


def _readers(engine) -> dict[str, tuple[str, int]]:
    """op type -> (op type, axis or transB) of the nodes reading a [V, H] / [H, V] table."""
    m = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    names = {name for name, *_ in _tables(engine)}
    got = {}
    for n in m.graph.node:
        if any(i in names for i in n.input):
            attrs = {a.name: a.i for a in n.attribute}
            got[n.op_type] = attrs.get("axis", attrs.get("transB", 0))
    return got


@pytest.mark.parametrize("arch", ["gemma3", "gpt2"])
def test_tied_embedding_stored_once_and_tokens_unchanged(arch, tiny_model_dir, tiny_engine):
    engine = tiny_engine(arch)
    assert _stored(_tables(engine)) == [([VOCAB, HIDDEN], onnx.TensorProto.FLOAT)]  # the embedding's table, once
    assert len(_tables(engine)) == 2  # under two names: the gather's and the head's
    assert _readers(engine) == {"Gather": 0, "FusedMatMul": 1}  # row gather; the head reads it transposed
    src = tiny_model_dir(arch)
    ids = AutoTokenizer.from_pretrained(src)("The history of the city").input_ids
    with trtinfer.load(engine) as eng:
        out = eng.generate(input_ids=[ids], max_new_tokens=8, ignore_eos=True)[0]
    assert out.token_ids == hf_greedy(src, ids, 8, eos_token_id=None, min_new_tokens=8)


def test_untied_embedding_keeps_both(tiny_engine):
    assert _stored(_tables(tiny_engine("llama"))) == [([HIDDEN, VOCAB], 1), ([VOCAB, HIDDEN], 1)]
    assert _readers(tiny_engine("llama")) == {"Gather": 0, "MatMul": 0}


def test_disabling_the_pass_keeps_both_tables(tiny_engine):
    tables = _tables(tiny_engine("gemma3", disable_passes=("tied_embedding",)))
    assert _stored(tables) == [([HIDDEN, VOCAB], 1), ([VOCAB, HIDDEN], 1)]


def test_fp16_engine_stores_the_tied_table_once(tiny_engine):
    """fp16 (no FusedMatMul kernel on the CPU): the embedding reads the head's weight along axis 1."""
    engine = tiny_engine("gemma3", precision="fp16")
    assert _stored(_tables(engine)) == [([HIDDEN, VOCAB], onnx.TensorProto.FLOAT16)]
    assert _readers(engine)["Gather"] == 1


def test_int4_engine_shares_its_packed_head(tiny_engine):
    """Quantizers tie their own way (GatherBlockQuantized on the head's packed codes): no float table is left."""
    engine = tiny_engine("gemma3", precision="int4")
    assert _tables(engine) == []
    m = onnx.load(str(engine / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in m.graph.node}
    assert "GatherBlockQuantized" in ops and "MatMulNBits" in ops
    # the gather and the head read the same 4-bit blocks under two names (ONNX Runtime drops the packed head's map)
    where = {t.name: tuple((e.key, e.value) for e in t.external_data) for t in m.graph.initializer}
    codes = next(n.input[0] for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    head = [n.input[1] for n in m.graph.node if n.op_type == "MatMulNBits" and where.get(n.input[1]) == where[codes]]
    assert where[codes] and len(head) == 1 and head[0] != codes


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


@pytest.mark.parametrize("head_reads_table", [False, True])
def test_rewrite_computes_the_same_and_drops_a_table(head_reads_table):
    model, e, _ = _head_graph(tied=True)
    ids = np.array([[0, 3, 10], [7, 7, 1]], dtype=np.int64)
    before = _run(model, ids)
    assert share_tied_embedding(model, vocab_size=11, head_reads_table=head_reads_table)
    assert set(model.graph.initializers) == ({"E"} if head_reads_table else {"W"})
    after = _run(model, ids)
    np.testing.assert_array_equal(after[1], e[ids])  # the embedding
    np.testing.assert_allclose(after[0], before[0], rtol=1e-6, atol=1e-6)


def test_rewrite_leaves_an_untied_pair():
    model, _, _ = _head_graph(tied=False)
    assert not share_tied_embedding(model, vocab_size=11)
    assert set(model.graph.initializers) == {"E", "W"}
