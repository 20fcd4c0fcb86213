"""A stage's graph run piece by piece gives every calibration run the same values as the whole graph: the GPTQ
statistics (X^T X of every MatMul input, prefill and decode runs) of tiny Llama/Gemma-3 graphs of both KV layouts,
cut as finely as the rules allow, equal those of one whole-graph session; a GPTQ quantize stage in pieces writes
the same codes as in one piece."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from trtinfer.calibration import CalibrationSet, StageFeeds, collect, weight_matmul_inputs
from trtinfer.calibration.data import kv_names
from trtinfer.calibration.pieces import collect_in_pieces, piece_model, plan
from trtinfer.export import ExportConfig, export
from trtinfer.passes import PassConfig
from trtinfer.passes.optimizer import optimize_stage
from trtinfer.stage_weights import load_graph, materialized

WINDOWS = ((5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 31, 2, 77, 19), (8, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14))


@pytest.fixture(scope="module")
def stages(tiny_model_dir, tmp_path_factory):
    made = {}

    def get(arch: str, layout: str):
        if (arch, layout) not in made:
            root = tmp_path_factory.mktemp(f"pieces-{arch}")
            exp = export(tiny_model_dir(arch), root / "exp", ExportConfig())
            made[arch, "concat"] = exp
            made[arch, "shared_buffer"] = optimize_stage(exp, root / "opt", PassConfig(max_seq_len=64))
        return made[arch, layout]

    return get


def sums(runner, stage, tensors) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    xtx: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}

    def add(t: str, x: np.ndarray) -> None:
        x2 = x.reshape(-1, x.shape[-1]).astype(np.float64)
        xtx[t] = xtx.get(t, 0) + x2.T @ x2
        rows[t] = rows.get(t, 0) + x2.shape[0]

    runner(add)
    return xtx, rows


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("layout", ["concat", "shared_buffer"])
def test_pieces_see_what_the_whole_graph_sees(stages, arch, layout):
    stage = stages(arch, layout)
    assert stage.kv_layout == layout
    tensors = weight_matmul_inputs(stage)
    feeds = StageFeeds(stage, CalibrationSet(WINDOWS, seq_len=10, decode_steps=4, source="t"), all_logits=True)
    cut = plan(load_graph(stage.onnx_path), tensors, budget=1)  # as fine as the rules allow
    layers = int(stage.geometry["num_layers"])
    assert len(cut) > 2 * layers  # several pieces per decoder layer
    assert sorted(t for p in cut for t in p.wanted) == sorted(tensors)  # each tensor in exactly one piece
    whole, whole_rows = sums(lambda add: collect(stage, feeds, tensors, add, progress=False), stage, tensors)
    done: list[tuple[str, ...]] = []
    parts, part_rows = sums(lambda add: done.extend(collect_in_pieces(stage, feeds, tensors, add, budget=1,
                                                                      progress=False)), stage, tensors)
    assert len(done) == len(cut) and sorted(t for d in done for t in d) == sorted(tensors)
    assert part_rows == whole_rows and set(parts) == set(tensors)
    assert whole_rows[tensors[0]] == len(WINDOWS) * (10 + 4)  # every prefill token and every decode step
    for t in tensors:
        scale = np.abs(whole[t]).max()
        assert scale > 0 and np.abs(parts[t] - whole[t]).max() <= 1e-5 * scale, t
    assert not list(stage.path.parent.glob(".piece-*"))  # every piece's weights were removed


def test_a_cut_never_splits_the_readers_of_one_tensor(stages):
    stage = stages("llama", "shared_buffer")
    model = load_graph(stage.onnx_path)
    tensors = weight_matmul_inputs(stage)
    nodes = list(model.graph)
    for piece in plan(model, tensors, budget=1):
        for t in piece.wanted:
            readers = [i for i, n in enumerate(nodes) if any(v is not None and v.name == t for v in n.inputs)]
            assert all(piece.start <= i < piece.stop for i in readers), t
    whole = plan(model, tensors)  # the default budget: a tiny model is one piece
    assert len(whole) == 1 and whole[0].inputs == tuple(sorted(v.name for v in model.graph.inputs))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_calibration_pieces_leave_out_the_lm_head_product(stages, arch):
    """Calibration reads the MatMul inputs and threads the KV, never the logits: the LM head's input is the last
    piece's output, its product is not computed (on Gemma-3-270M it was 63% of the calibration FLOPs), and the
    statistics are those of the whole graph whatever the cut."""
    stage = stages(arch, "shared_buffer")
    tensors = weight_matmul_inputs(stage)
    presents = kv_names(stage)[1]
    head = next(n for n in load_graph(stage.onnx_path).graph if n.outputs[0].name == "logits")
    while head.op_type != "MatMul":  # the product behind the logits (a Cast or Reshape may follow it)
        head = head.inputs[0].producer()
    assert head.inputs[0].name in tensors

    def made(outputs):
        (piece,) = plan(load_graph(stage.onnx_path), tensors, outputs=outputs)  # a tiny model is one piece
        model = piece_model(stage.onnx_path, piece, {})
        return {v.name for n in model.graph for v in n.outputs}, {v.name for v in model.graph.outputs}

    values, outs = made(presents)
    assert head.outputs[0].name not in values and "logits" not in values
    assert outs == set(presents) | set(tensors)
    values, outs = made(None)  # every graph output by default: the logits are made
    assert head.outputs[0].name in values and "logits" in outs
    # a budget under the LM head's weight, which would cut before it: the product, left out, rides with the piece
    # before it, as no piece is made only of what feeds nothing (a Qwen3-8B-shape slice got an empty piece)
    head_bytes = sum(v.const_value.nbytes for v in head.inputs if v is not None and v.const_value is not None)
    budget = head_bytes - 1
    feeds = StageFeeds(stage, CalibrationSet(WINDOWS, seq_len=10, decode_steps=4, source="t"), all_logits=True)
    whole, rows = sums(lambda add: collect(stage, feeds, tensors, add, progress=False), stage, tensors)
    parts, part_rows = sums(lambda add: list(collect_in_pieces(stage, feeds, tensors, add, budget=budget,
                                                               progress=False)), stage, tensors)
    assert part_rows == rows and set(parts) == set(tensors)
    for t in tensors:
        assert np.abs(parts[t] - whole[t]).max() <= 1e-5 * np.abs(whole[t]).max(), t


def test_gptq_in_pieces_writes_what_one_piece_writes(stages, tmp_path, monkeypatch):
    from trtinfer.calibration import CalibrationConfig
    from trtinfer.calibration import pieces as pieces_module
    from trtinfer.quantization import QuantConfig, quantize_stage

    stage = stages("llama", "shared_buffer")
    cfg = QuantConfig(precision="int4", method="gptq",
                      calibration=CalibrationConfig(num_samples=4, seq_len=32, decode_steps=2))
    one = quantize_stage(stage, tmp_path / "one", cfg, progress=False)
    monkeypatch.setattr(pieces_module, "PIECE_BYTES", 1)  # the budget gptq_stats asks for
    many = quantize_stage(stage, tmp_path / "many", cfg, progress=False)
    assert one.history["quantize"]["report"]["calibration"]["pieces"] == 1
    assert many.history["quantize"]["report"]["calibration"]["pieces"] > 2 * int(stage.geometry["num_layers"])
    assert not list(many.path.rglob(".piece-*"))  # the pieces' files went to the stage's scratch folder, and went
    assert not (many.path / ".scratch").exists()  # GPTQ's blocks waited there until the graph was saved
    a = onnx.load(str(one.onnx_path))
    b = {t.name: t for t in onnx.load(str(many.onnx_path)).graph.initializer}
    packed = [t for t in a.graph.initializer if t.data_type == onnx.TensorProto.UINT8]
    assert packed
    for t in packed:
        codes_a, codes_b = onnx.numpy_helper.to_array(t), onnx.numpy_helper.to_array(b[t.name])
        assert np.mean(codes_a == codes_b) > 0.999, t.name  # float sums in another order may flip a rare code


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_reference_scores_in_pieces_equal_the_runtime_scores(stages, arch):
    """The quantize stage's fp32 reference (held-out log-probs and top-1, run in pieces) = the runtime's scoring of
    the whole graph."""
    from trtinfer.quantization.accuracy import graph_scores, held_out_ids
    from trtinfer.runtime.config import RuntimeConfig
    from trtinfer.runtime.scoring import open_stage_session, score_ids

    stage = stages(arch, "shared_buffer")
    ids = held_out_ids(stage.path / "tokenizer.json", 60, int(stage.geometry["vocab_size"]))
    assert len(ids) == 60
    logprobs, top = graph_scores(stage, ids, budget=1)
    with materialized(stage) as copy, open_stage_session(copy, RuntimeConfig(prepack_weights=False)) as sess:
        whole = score_ids(sess, ids)  # the whole graph, its weights written out of the checkpoint
    assert logprobs.shape == whole.logprobs.shape == (59,)
    np.testing.assert_allclose(logprobs, whole.logprobs, atol=1e-4)
    np.testing.assert_array_equal(top, whole.argmax)


def test_quantized_scores_in_pieces_equal_the_runtime_scores(stages, tmp_path):
    """The quantize stage scores its own int4 graph in pieces too (MatMulNBits packed, as the engine runs it): the
    same log-probs and top-1 as the runtime's session on the whole quantized graph."""
    from trtinfer.quantization import QuantConfig, quantize_stage
    from trtinfer.quantization.accuracy import graph_scores, held_out_ids
    from trtinfer.runtime.scoring import open_stage_session, score_ids

    stage = stages("llama", "shared_buffer")
    q = quantize_stage(stage, tmp_path / "q", QuantConfig(precision="int4", method="rtn"), progress=False)
    ids = held_out_ids(stage.path / "tokenizer.json", 60, int(stage.geometry["vocab_size"]))
    logprobs, top = graph_scores(q, ids, budget=1, scratch=tmp_path)
    assert not list(tmp_path.glob(".piece-*"))
    with open_stage_session(q) as sess:
        whole = score_ids(sess, ids)
    np.testing.assert_allclose(logprobs, whole.logprobs, atol=1e-3)
    assert np.mean(top == whole.argmax) > 0.95
    acc = q.history["quantize"]["accuracy"]  # the stage's own report: these figures
    assert acc["perplexity"] == pytest.approx(np.exp(-logprobs.mean()), rel=1e-3)
