"""GroupQueryAttention fusion + shared KV buffers: rule tests on a hand-written layer, numerics on tiny exports."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from tiny_models import whole_file

from trtinfer.export.reference import reference_logits
from trtinfer.passes import PassConfig, PassContext, optimize, optimize_model
from trtinfer.passes.attention import fuse_gqa
from trtinfer.passes.layout import SHARED

sys.path.insert(0, str(Path(__file__).parents[1]))

H, KV, D = 4, 2, 8
G = H // KV
T = 5  # the reference graph's 5D view needs the key length; the test runs 5 tokens, no past
# one attention layer as trtinfer's exporter traces it (no rotary: GPT-2 style), 14 nodes
LAYER = f"""
<ir_version: 9, opset_import: ["" : 17]>
layer (float[B,S,{H},{D}] qh, float[B,S,{KV},{D}] kh, float[B,S,{KV},{D}] vh, float[B,{KV},P,{D}] past_k,
       float[B,{KV},P,{D}] past_v, float[B,1,S,T] mask) =>
      (float[B,S,{H * D}] out, float[B,{KV},T,{D}] {{KNAME}}, float[B,{KV},T,{D}] present_v)
<int64[4] s1 = {{0, {KV}, -1, {D}}}, float scale = {{0.35}}, int64[5] s2 = {{0, {KV}, {G}, -1, {T}}},
 int64[4] s3 = {{0, {KV}, -1, {T}}}, int64[4] s4 = {{0, {H}, -1, {D}}}, int64[3] s5 = {{0, 0, -1}}, int64[1] ax = {{2}}>
{{
  q = Transpose <perm = [0, 2, 1, 3]> (qh)
  k = Transpose <perm = [0, 2, 1, 3]> (kh)
  v = Transpose <perm = [0, 2, 1, 3]> (vh)
  {{KNAME}} = Concat <axis = -2> (past_k, k)
  present_v = Concat <axis = -2> (past_v, v)
  qg = Reshape (q, s1)
  kt = Transpose <perm = [0, 1, 3, 2]> ({{KNAME}})
  sc = MatMul (qg, kt)
  scs = Mul (sc, scale)
  s5d = Reshape (scs, s2)
  m5 = Unsqueeze (mask, ax)
  sm = Add (s5d, m5)
  s4d = Reshape (sm, s3)
  p = Softmax <axis = -1> (s4d)
  o = MatMul (p, present_v)
  o4 = Reshape (o, s4)
  ot = Transpose <perm = [0, 2, 1, 3]> (o4)
  out = Reshape (ot, s5)
}}
"""
GEOMETRY = {"num_layers": 1, "num_attention_heads": H, "num_kv_heads": KV, "head_dim": D,
            "layer_types": ["full_attention"], "sliding_window": None, "rotary": False}


def _layer(kname: str = "present_k") -> onnx.ModelProto:
    """The layer with the exporter's graph I/O names (the text parser takes no dots in names)."""
    text = LAYER.replace("{KNAME}", kname).replace("{{", "{").replace("}}", "}")
    model = ir.from_proto(onnx.parser.parse_model(text))
    names = {"past_k": "past_key_values.0.key", "past_v": "past_key_values.0.value", "present_k": "present.0.key",
             "present_v": "present.0.value"}
    for v in [*model.graph.inputs, *model.graph.outputs]:
        v.name = names.get(v.name, v.name)
    return ir.to_proto(model)


def _causal_mask(s: int) -> np.ndarray:
    m = np.triu(np.full((s, s), np.finfo(np.float32).min, np.float32), 1)
    return m[None, None]


def test_layer_fuses_and_matches_unfused() -> None:
    proto = _layer()
    model = ir.from_proto(proto)
    assert fuse_gqa(model, GEOMETRY, max_seq_len=64) == 1
    ir.passes.common.RemoveUnusedNodesPass()(model)
    ops = [n.op_type for n in model.graph]
    assert ops.count("GroupQueryAttention") == 1 and "Softmax" not in ops and "Concat" not in ops
    rng = np.random.default_rng(0)
    s = T
    qh, kh, vh = (rng.standard_normal((1, s, n, D)).astype(np.float32) for n in (H, KV, KV))
    empty = np.zeros((1, KV, 0, D), np.float32)
    ref = ort.InferenceSession(proto.SerializeToString()).run(None, {
        "qh": qh, "kh": kh, "vh": vh, "past_key_values.0.key": empty,
        "past_key_values.0.value": empty, "mask": _causal_mask(s)})
    fused = ort.InferenceSession(ir.to_proto(model).SerializeToString())
    got = fused.run(None, {"qh": qh, "kh": kh, "vh": vh, "past_key_values.0.key": empty,
                           "past_key_values.0.value": empty, "seqlens_k": np.array([s - 1], np.int32),
                           "total_sequence_length": np.array(s, np.int32),
                           "mask": np.full((1, 1, s, s), -1e9, np.float32)})  # unread: GQA masks by itself
    np.testing.assert_allclose(got[0], ref[0], atol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], atol=0)  # present key: the same values in the same layout


def test_layer_without_present_output_is_left_alone() -> None:
    model = ir.from_proto(_layer(kname="k_cat"))  # K concat is not the present.N.key graph output
    before = [n.op_type for n in model.graph]
    assert fuse_gqa(model, GEOMETRY, max_seq_len=64) == 0
    assert [n.op_type for n in model.graph] == before
    assert [v.name for v in model.graph.inputs][-1] == "mask"  # no seqlens inputs left behind


def test_partial_match_is_all_or_nothing() -> None:
    model = ir.from_proto(_layer())
    assert fuse_gqa(model, {**GEOMETRY, "num_layers": 2, "layer_types": ["full_attention"] * 2}, 64) == 0
    assert not any(n.op_type == "GroupQueryAttention" for n in model.graph)


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    from trtinfer.export.onnx_export import export

    made = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = whole_file(export(tiny_model_dir(arch), tmp_path_factory.mktemp(f"onnx-{arch}") / "x").onnx_path)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2", "qwen3"])
def test_tiny_model_shared_buffers_match_unfused(arch: str, exports, tmp_path: Path) -> None:
    """Right-padded ragged batch on shared KV buffers == each row alone on the unfused graph (gemma3: window 5)."""
    src = exports(arch)
    dst = tmp_path / "model.onnx"
    report = optimize(src, dst, PassConfig(target="onnxruntime-cpu", max_seq_len=64))
    assert report.fired("attention") == report.to_dict()["fusions"]["attention"]["expected"] > 0
    assert report.fired("kv_share_buffer") == 1 and report.fired("logits_positions") == 1
    assert ir.load(str(dst)).metadata_props["trtinfer.kv_layout"] == SHARED
    rng = np.random.default_rng(1)
    lens, steps, cap = [9, 4, 7], 6, 24
    prompts = [rng.integers(3, 300, n).astype(np.int64) for n in lens]
    ref = reference_logits(src, prompts, steps)

    sess = ort.InferenceSession(str(dst))
    names = [i.name for i in sess.get_inputs()]
    past = [i for i in sess.get_inputs() if i.name.startswith("past")]
    bufs = [ort.OrtValue.ortvalue_from_numpy(np.zeros((3, x.shape[1], cap, x.shape[3]), np.float32)) for x in past]

    def run(ids: np.ndarray, seqlens: list[int], total: int, pos: np.ndarray, last: list[int]) -> np.ndarray:
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("logits_positions", np.asarray(last, np.int64)[:, None])  # each row's last token
        io.bind_cpu_input("seqlens_k", np.asarray(seqlens, np.int32))
        io.bind_cpu_input("total_sequence_length", np.asarray(total, np.int32))
        if "position_ids" in names:
            io.bind_cpu_input("position_ids", pos)
        io.bind_output("logits", "cpu")  # first: get_outputs() follows binding order
        for x, v in zip(past, bufs):
            io.bind_ortvalue_input(x.name, v)
            io.bind_ortvalue_output(x.name.replace("past_key_values", "present"), v)
        sess.run_with_iobinding(io)
        return io.get_outputs()[0].numpy()[:, 0]

    ids = np.zeros((3, max(lens)), np.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    got = [[row] for row in run(ids, [n - 1 for n in lens], max(lens), np.tile(np.arange(max(lens)), (3, 1)),
                                [n - 1 for n in lens])]
    cur = list(lens)
    for t in range(steps):
        toks = np.array([[ref[b][1][t]] for b in range(3)])
        for b, row in enumerate(run(toks, cur, max(cur) + 1, np.array(cur)[:, None], [0, 0, 0])):
            got[b].append(row)
        cur = [c + 1 for c in cur]
    for b in range(3):
        np.testing.assert_allclose(np.stack(got[b]), ref[b][0], atol=2e-4 * max(1.0, float(np.abs(ref[b][0]).max())))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tensorrt_pipeline_keeps_plain_attention(arch: str, exports) -> None:
    """MatMul-Softmax-MatMul per layer, nothing but scale/mask between: no IsNaN/Where guards in the core."""
    model = ir.load(str(exports(arch)))
    report = optimize_model(model, PassConfig(target="tensorrt"))
    ops = [n.op_type for n in model.graph]
    assert report.fired("attention") == 0 and "GroupQueryAttention" not in ops and "IsNaN" not in ops
    assert not any(n.domain == "com.microsoft" for n in model.graph)
    softmaxes = [n for n in model.graph if n.op_type == "Softmax"]
    assert len(softmaxes) == {"llama": 2, "gemma3": 3}[arch]  # one per layer
    for sm in softmaxes:
        assert [c.op_type for c in sm.outputs[0].consumers()] == ["MatMul"]  # probabilities straight into P @ V
        node, chain = sm.inputs[0].producer(), []
        while node is not None and node.op_type != "MatMul":  # back along the scores to Q @ K^T
            chain.append(node.op_type)
            node = node.inputs[0].producer() if node.inputs[0] is not None else None
        assert node is not None and chain == ["Add"], chain  # scores + mask, nothing else
        q_scale = node.inputs[0].producer()  # TensorRT wants the scale on Q, before the first MatMul
        assert q_scale.op_type == "Mul" and q_scale.inputs[1].const_value is not None
        k_t = node.inputs[1].producer()
        assert k_t.op_type == "Transpose" and k_t.inputs[0].producer().op_type == "Reshape"  # repeated KV heads


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3", "gpt2"])
def test_tensorrt_attention_matches_unfused(arch: str, exports, tmp_path: Path) -> None:
    """The TensorRT-form attention computes the same logits, prefill and decode (gemma3: sliding window 5)."""
    src = exports(arch)
    dst = tmp_path / "model.onnx"
    # the concat KV layout, which reference_logits feeds (kv_scatter's own test covers the scatter layout)
    report = optimize(src, dst, PassConfig(target="tensorrt", disable=("kv_scatter",)))
    layers = {"llama": 2, "gemma3": 3, "qwen3": 2, "gpt2": 2}[arch]
    assert report.fired("tensorrt_attention") == layers
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, n).astype(np.int64) for n in (9, 4)]
    for (ref, ref_toks), (got, toks) in zip(reference_logits(src, prompts, 6), reference_logits(dst, prompts, 6)):
        assert toks == ref_toks
        np.testing.assert_allclose(got, ref, atol=1e-4 * max(1.0, float(np.abs(ref).max())))


def test_tensorrt_attention_needs_present_keys(exports) -> None:
    """Positive and negative on the same cleaned graph: keys that are not a present.N.key output are left alone."""
    from trtinfer.passes.trt_attention import tensorrt_attention

    only_cleanup = ("tensorrt_attention", "rms_norm", "layer_norm", "gelu", "precision", "dead_code", "tensorrt_check")
    fired = []
    for rename in (False, True):
        model = ir.load(str(exports("llama")))
        optimize_model(model, PassConfig(target="tensorrt", disable=only_cleanup))
        if rename:
            for out in model.graph.outputs:
                out.name = (out.name or "").replace("present.", "kv_out.")
        fired.append(tensorrt_attention(model, PassContext.for_model(model, PassConfig(target="tensorrt"))))
    assert fired == [2, 0]
