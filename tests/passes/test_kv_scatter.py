"""kv_scatter: concat KV cache + attention_mask masks -> TensorScatter into preallocated buffers + position masks.

Rule tests on a hand-written decode layer (numbers against the concat graph on onnx's reference evaluator and ONNX
Runtime), then tiny llama / gemma3 exports: the tensorrt graph on right-padded buffers (in place with IOBinding) ==
the concat-layout tensorrt graph run left-padded; the opset upgrade it relies on; the TensorRT op check.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from tests.passes._fusion_checks import export_once, run_ort
from trtinfer.errors import ConfigError
from trtinfer.passes import PassConfig, PassContext, optimize
from trtinfer.passes.kv_scatter import SCATTER, kv_scatter, layers_reading
from trtinfer.passes.layout import LAYOUT_KEY
from trtinfer.passes.opset import upgrade_opset
from trtinfer.passes.trt_support import (
    TENSORRT_ONNX_OPS,
    TENSORRT_OPSETS,
    tensorrt_check,
    tensorrt_problems,
    unsupported_ops,
)

D = 4
LOWEST = float(np.finfo(np.float32).min)
# one decode step of one attention head as the exporter traces it (no scale, no rotary), 10 nodes; the mask is the
# exporter's padding mask for one query (causality is trivial then)
LAYER = f"""
<ir_version: 10, opset_import: ["" : 17]>
layer (float[B,1,S,{D}] q, float[B,1,S,{D}] k, float[B,1,S,{D}] v, float[B,1,P,{D}] past_k, float[B,1,P,{D}] past_v,
       int64[B,T] attention_mask, int64[B,S] position_ids) =>
      (float[B,1,S,{D}] out, float[B,1,T,{D}] present_k, float[B,1,T,{D}] present_v)
<int64[2] ax = {{1, 2}}, float zero = {{0.0}}, float lowest = {{{LOWEST!r}}}>
{{
  present_k = Concat <axis = -2> (PAST_K, k)
  present_v = Concat <axis = -2> (past_v, v)
  kt = Transpose <perm = [0, 1, 3, 2]> (present_k)
  scores = MatMul (q, kt)
  m4 = Unsqueeze (attention_mask, ax)
  keep = Cast <to = 9> (m4)
  mask = Where (keep, zero, lowest)
  masked = Add (scores, mask)
  p = Softmax <axis = -1> (masked)
  out = MatMul (p, present_v)
}}
"""
GEOMETRY = {"num_layers": 1, "layer_types": ["full_attention"], "sliding_window": None}
CAP = 6  # KV slots (PassConfig.max_seq_len)
NAMES = {"past_k": "past_key_values.0.key", "past_v": "past_key_values.0.value", "present_k": "present.0.key",
         "present_v": "present.0.value"}


def _layer(past_k: str = "past_k") -> onnx.ModelProto:
    """The layer with the exporter's KV names (the text parser takes no dots in names)."""
    model = ir.from_proto(onnx.parser.parse_model(LAYER.replace("PAST_K", past_k)))
    for v in [*model.graph.inputs, *model.graph.outputs]:
        v.name = NAMES.get(v.name or "", v.name)
    return ir.to_proto(model)


def _scatter(proto: onnx.ModelProto, target: str = "tensorrt") -> tuple[ir.Model, int]:
    model = ir.from_proto(proto)
    return model, kv_scatter(model, PassContext(PassConfig(target=target, max_seq_len=CAP), dict(GEOMETRY)))


def test_layer_scatters_and_matches_concat() -> None:
    before = _layer()
    model, fired = _scatter(before)
    assert fired == 1
    assert [n.op_type for n in model.graph].count("TensorScatter") == 2 and "Concat" not in [n.op_type
                                                                                             for n in model.graph]
    assert [v.name for v in model.graph.inputs if v.name == "attention_mask"] == []
    assert model.opset_imports[""] == 24 and model.metadata_props[LAYOUT_KEY] == SCATTER
    assert model.graph.inputs[3].shape[2] == CAP and model.graph.outputs[1].shape[2] == CAP  # static: TensorRT
    after = ir.to_proto(model)
    onnx.checker.check_model(after, full_check=True)

    # row 0 has 3 cached tokens; row 1 has 1 (left-padded by 2 in the concat layout)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 1, 1, D)).astype(np.float32) for _ in range(3))
    past_k, past_v = (rng.standard_normal((2, 1, 3, D)).astype(np.float32) for _ in range(2))
    am = np.array([[1, 1, 1, 1], [0, 0, 1, 1]], np.int64)
    ref = ReferenceEvaluator(before).run(None, {"q": q, "k": k, "v": v, NAMES["past_k"]: past_k,
                                                NAMES["past_v"]: past_v, "attention_mask": am,
                                                "position_ids": np.array([[3], [1]])})
    # the same cache from slot 0 on, in buffers of CAP slots; row 1's slots 1.. hold garbage (finite)
    buf_k, buf_v = (rng.standard_normal((2, 1, CAP, D)).astype(np.float32) * 100 for _ in range(2))
    buf_k[0, :, :3], buf_v[0, :, :3] = past_k[0], past_v[0]
    buf_k[1, :, :1], buf_v[1, :, :1] = past_k[1, :, 2:], past_v[1, :, 2:]
    feeds = {"q": q, "k": k, "v": v, NAMES["past_k"]: buf_k, NAMES["past_v"]: buf_v,
             "position_ids": np.array([[3], [1]])}
    for got in (ReferenceEvaluator(after).run(None, feeds), run_ort(after, feeds)):
        np.testing.assert_allclose(got[0], ref[0], atol=1e-6)
        for new, old, buf in ((got[1], ref[1], buf_k), (got[2], ref[2], buf_v)):
            np.testing.assert_array_equal(new[0, :, :4], old[0])  # row 0: slots 0..3 = its 4 tokens
            np.testing.assert_array_equal(new[1, :, :2], old[1, :, 2:])  # row 1: slots 0..1 = its 2 tokens
            np.testing.assert_array_equal(new[0, :, 4:], buf[0, :, 4:])  # the rest is left as it was
            np.testing.assert_array_equal(new[1, :, 2:], buf[1, :, 2:])


@pytest.mark.parametrize("case", ["no_concat_of_past", "onnxruntime_target"])
def test_layer_left_alone(case: str) -> None:
    """No Concat reading a past input (K concatenates k with itself), or another target: fires 0, no change."""
    proto = _layer(past_k="k") if case == "no_concat_of_past" else _layer()
    model, fired = _scatter(proto, "onnxruntime-cpu" if case == "onnxruntime_target" else "tensorrt")
    assert fired == 0
    assert [n.op_type for n in model.graph] == [n.op_type for n in proto.graph.node]
    assert "attention_mask" in [v.name for v in model.graph.inputs]
    assert model.opset_imports[""] == 17 and LAYOUT_KEY not in model.metadata_props


# --- opset upgrade --------------------------------------------------------------------------------------------------

POOL = """
<ir_version: 10, opset_import: ["" : 17]>
g (float[1,1,5,5] x) => (float[1,1,1,1] y)
{ p = MaxPool <kernel_shape = [2, 2], strides = [2, 2], ceil_mode = CEIL> (x)
  y = ReduceMean <axes = [2, 3], keepdims = 1> (p) }
"""


def test_upgrade_to_24_moves_axes_and_refuses_changed_pools() -> None:
    """MaxPool with ceil_mode=1 changed at opset 22 (windows starting in the right padding dropped): refused."""
    with pytest.raises(ConfigError, match="MaxPool changed meaning"):
        upgrade_opset(ir.from_proto(onnx.parser.parse_model(POOL.replace("CEIL", "1"))), 24)
    proto = onnx.parser.parse_model(POOL.replace("CEIL", "0"))
    model = ir.from_proto(proto)
    assert upgrade_opset(model, 24) == {"ReduceMean": 1} and model.opset_imports[""] == 24
    x = np.random.default_rng(0).standard_normal((1, 1, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(run_ort(ir.to_proto(model), {"x": x})[0], run_ort(proto, {"x": x})[0], rtol=1e-6)


# --- tiny exports ---------------------------------------------------------------------------------------------------

LAYERS = {"llama": 2, "gemma3": 3}
LENGTHS, STEPS, SLOTS = (9, 4), 3, 16  # gemma3's window is 5: the 9-token row crosses it


@pytest.fixture(scope="module")
def graphs(tiny_model_dir, tmp_path_factory):
    """``graphs(arch)`` -> (export, tensorrt graph, its report, tensorrt graph without kv_scatter)."""
    made: dict[str, tuple] = {}

    def get(arch: str) -> tuple:
        if arch not in made:
            src = export_once(arch, tiny_model_dir, tmp_path_factory)
            out = tmp_path_factory.mktemp(f"kv-scatter-{arch}")
            report = optimize(src, out / "scatter.onnx", PassConfig(target="tensorrt", max_seq_len=SLOTS))
            optimize(src, out / "concat.onnx", PassConfig(target="tensorrt", disable=("kv_scatter",)))
            made[arch] = (src, out / "scatter.onnx", report, out / "concat.onnx")
        return made[arch]

    return get


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feeds_data() -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, 300, n).astype(np.int64) for n in LENGTHS], rng.integers(3, 300, (STEPS, len(LENGTHS)))


def _concat_left_padded(path: Path) -> np.ndarray:
    """Logits ``[steps + 1, rows, V]`` of the concat graph: left-padded prefill, then decode (the old runtime way)."""
    sess = _session(path)
    prompts, tokens = _feeds_data()
    past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    rows, width = len(prompts), max(LENGTHS)
    ids, mask = np.zeros((rows, width), np.int64), np.zeros((rows, width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.clip(np.cumsum(mask, 1) - 1, 0, None),
             "logits_positions": np.full((rows, 1), width - 1),
             **{x.name: np.zeros((rows, x.shape[1], 0, x.shape[3]), np.float32) for x in past}}
    out = sess.run(None, feeds)
    logits, lengths = [out[0][:, 0]], np.array(LENGTHS)
    for t in range(STEPS):
        mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], axis=1)
        feeds = {"input_ids": tokens[t][:, None], "attention_mask": mask, "position_ids": (lengths + t)[:, None],
                 "logits_positions": np.zeros((rows, 1), np.int64), **{x.name: v for x, v in zip(past, out[1:])}}
        out = sess.run(None, feeds)
        logits.append(out[0][:, 0])
    return np.stack(logits)


def _scatter_right_padded(path: Path, in_place: bool) -> np.ndarray:
    """Logits ``[steps + 1, rows, V]`` of the scatter graph: right-padded prefill into zeroed buffers of
    ``SLOTS``, then decode at each row's next position; ``in_place`` binds present.* to past.*'s buffers."""
    sess = _session(path)
    prompts, tokens = _feeds_data()
    past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    rows, width = len(prompts), max(LENGTHS)
    bufs = [np.zeros((rows, x.shape[1], SLOTS, x.shape[3]), np.float32) for x in past]
    values = [ort.OrtValue.ortvalue_from_numpy(b) for b in bufs]

    def step(ids: np.ndarray, positions: np.ndarray, last: np.ndarray) -> np.ndarray:
        nonlocal bufs
        feeds = {"input_ids": ids, "position_ids": positions, "logits_positions": last}
        if not in_place:
            out = sess.run(None, {**feeds, **{x.name: b for x, b in zip(past, bufs)}})
            bufs = out[1:]
            return out[0][:, 0]
        io = sess.io_binding()
        for name, value in feeds.items():
            io.bind_cpu_input(name, value)
        io.bind_output("logits", "cpu")
        for x, value in zip(past, values):
            io.bind_ortvalue_input(x.name, value)
            io.bind_ortvalue_output(x.name.replace("past_key_values", "present"), value)
        sess.run_with_iobinding(io)
        outs = io.get_outputs()
        assert [o.data_ptr() for o in outs[1:]] == [v.data_ptr() for v in values]  # present.* is past.*'s buffer
        return outs[0].numpy()[:, 0]

    ids = np.zeros((rows, width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    lengths = np.array(LENGTHS)
    logits = [step(ids, np.tile(np.arange(width), (rows, 1)), (lengths - 1)[:, None])]
    for t in range(STEPS):
        logits.append(step(tokens[t][:, None], (lengths + t)[:, None], np.zeros((rows, 1), np.int64)))
    return np.stack(logits)


@pytest.mark.parametrize("arch", sorted(LAYERS))
def test_tiny_scatter_layout_graph(arch: str, graphs) -> None:
    """One TensorScatter per KV tensor, attention_mask gone, KV of max_seq_len static slots, opset 24, TensorRT ops."""
    _, path, report, _ = graphs(arch)
    layers = LAYERS[arch]
    assert report.fired("kv_scatter") == report.to_dict()["fusions"]["kv_scatter"]["expected"] == layers
    model = ir.load(str(path))
    assert model.metadata_props[LAYOUT_KEY] == SCATTER and model.opset_imports[""] == 24
    assert [n.op_type for n in model.graph].count("TensorScatter") == 2 * layers
    assert not any(n.op_type == "Concat" and any((x.name or "").startswith("past_key_values") for x in n.inputs)
                   for n in model.graph)
    assert [v.name for v in model.graph.inputs] == ["input_ids", "position_ids", "logits_positions",
                                                     *[f"past_key_values.{i}.{kv}" for i in range(layers)
                                                       for kv in ("key", "value")]]
    for v in [*model.graph.inputs[3:], *model.graph.outputs[1:]]:
        assert v.shape[2] == SLOTS
    # each mask reaches the layers of its kind (gemma3: layers 0, 1 sliding, 2 full)
    masks = {v.name: layers_reading(v) for n in model.graph for v in n.outputs
             if (v.name or "").startswith("kv_scatter/")}
    expected = {"llama": {"kv_scatter/full_attention_mask": {0, 1}},
                "gemma3": {"kv_scatter/full_attention_mask": {2}, "kv_scatter/sliding_attention_mask": {0, 1}}}
    assert {k: m for k, m in masks.items() if k.endswith("_mask")} == expected[arch]
    # the pipeline's own check passed (it raises otherwise); and again here, explicitly
    assert report.fired("tensorrt_check") == 0 and unsupported_ops(model) == {} and tensorrt_problems(model) == []
    assert "TensorScatter" in TENSORRT_ONNX_OPS and TENSORRT_OPSETS[0] <= 24 <= TENSORRT_OPSETS[1]
    assert tensorrt_check(model, PassContext(PassConfig(target="tensorrt"), {})) == 0


@pytest.mark.parametrize("arch", sorted(LAYERS))
def test_tiny_right_padded_buffers_match_concat_layout(arch: str, graphs) -> None:
    """Right-padded batch of 2 (9 and 4 tokens) + 3 decode steps on 16-slot buffers == the concat graph
    left-padded, at every row's real tokens; binding present.* to past.*'s buffers (in place) gives the same."""
    _, path, _, concat = graphs(arch)
    ref = _concat_left_padded(concat)
    copied = _scatter_right_padded(path, in_place=False)
    in_place = _scatter_right_padded(path, in_place=True)
    assert np.abs(copied - ref).max() <= 1e-4, np.abs(copied - ref).max()  # measured: llama 1.1e-6, gemma3 1.8e-6
    np.testing.assert_array_equal(in_place, copied)


def test_tiny_last_column_logits_keep_concat(graphs, tmp_path: Path) -> None:
    """Without logits_positions the LM head reads the last column, a pad of short right-padded rows: fires 0."""
    src = graphs("llama")[0]
    report = optimize(src, tmp_path / "m.onnx", PassConfig(target="tensorrt", max_seq_len=SLOTS,
                                                           disable=("logits_positions",)))
    assert report.fired("kv_scatter") == 0
    model = ir.load(str(tmp_path / "m.onnx"))
    assert "attention_mask" in [v.name for v in model.graph.inputs] and LAYOUT_KEY not in model.metadata_props
