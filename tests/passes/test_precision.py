"""fp16/bf16 conversion: which ops stay fp32, casts, constant clipping, numerics vs fp32 (ORT CPU runs fp16; bf16 is
checked by emulation), engines built in fp16 on CPU, and the TensorRT pipeline in fp16."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from tiny_models import whole_file

import trtinfer
from tests.passes._fusion_checks import fill, floats
from trtinfer.errors import ConfigError
from trtinfer.passes import PassConfig, optimize, optimize_model
from trtinfer.passes.precision import convert_precision, emulate_low_precision, to_low
from trtinfer.passes.trt_support import TENSORRT_ONNX_OPS
from trtinfer.runtime.slots import SlotCache

F16, BF16, F32 = ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT

# residual Add -> LayerNorm -> MatMul -> + mask (with a -3.4e38 "minus infinity") -> Softmax -> MatMul
BLOCK = """
<ir_version: 9, opset_import: ["" : 17]>
block (float[2,8] x, float[2,8] r) => (float[2,8] o, float[2,8] h)
<float[8] g1 = {G}, float[8] b1 = {B}, float[8,8] w = {W}, float[8] mask = {{0,0,0,0,0,0,-3.4e38,-3.4e38}},
 float[8,8] w2 = {W2}>
{{
  h = Add(x, r)
  n = LayerNormalization<axis=-1, epsilon=1e-5>(h, g1, b1)
  y = MatMul(n, w)
  m = Add(y, mask)
  p = Softmax<axis=-1>(m)
  o = MatMul(p, w2)
}}
"""

# rotary angles from integer positions: position * inv_freq must not be rounded to fp16
ROTARY = """
<ir_version: 9, opset_import: ["" : 17]>
rot (int64[1,4] pos, float[1,4,8] q) => (float[1,4,8] out)
<float[8] inv = {INV}, int64[1] ax = {{2}}>
{{
  pf = Cast<to=1>(pos)
  pu = Unsqueeze(pf, ax)
  ang = Mul(pu, inv)
  c = Cos(ang)
  out = Mul(q, c)
}}
"""


def _block() -> onnx.ModelProto:
    text = fill(BLOCK, G=floats(8, 1, 0.1, 1.0), B=floats(8, 2, 0.1), W=floats(64, 3), W2=floats(64, 4))
    return onnx.parser.parse_model(text)


def _types(model: ir.Model) -> dict[str, ir.DataType | None]:
    """Output name (as written in the text graph) -> its dtype, for every node but the inserted Casts.

    A graph output produced in another type is renamed ``<name>_<type>`` and cast back to its name.
    """
    return {(n.outputs[0].name or "").removesuffix("_float").removesuffix("_float16"): n.outputs[0].dtype
            for n in model.graph if n.op_type != "Cast" or n.name in ("", None)}


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString()).run(None, feeds)


def test_block_fp16_keeps_sensitive_ops_fp32_and_matches() -> None:
    before = _block()
    model = ir.from_proto(before)
    n_low = convert_precision(model, "fp16")
    t = _types(model)
    assert n_low == 3  # the two MatMuls and the mask Add
    assert t["h"] == F32 and t["n"] == F32 and t["p"] == F32  # residual Add, LayerNorm, Softmax
    assert t["y"] == F16 and t["m"] == F16 and t["o"] == F16
    mask = model.graph.initializers["mask"]
    assert mask.dtype == F16 and np.isfinite(mask.const_value.numpy()).all()  # -3.4e38 clipped, not -inf
    assert {v.name: v.dtype for v in model.graph.outputs} == {"o": F16, "h": F16}
    after = ir.to_proto(model)
    onnx.checker.check_model(after, full_check=True)
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    ref = _run(before, {"x": x, "r": r})
    got = _run(after, {"x": x.astype(np.float16), "r": r.astype(np.float16)})
    assert all(np.isfinite(g).all() for g in got)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b.astype(np.float32), a, atol=1e-2 * max(1.0, float(np.abs(a).max())))


def test_keep_io_types_and_no_kept_groups() -> None:
    model = ir.from_proto(_block())
    convert_precision(model, "fp16", keep_fp32=(), keep_io_types=True)
    t = _types(model)
    assert t["n"] == F16 and t["p"] == F16 and t["h"] == F16  # nothing kept: norm, softmax, residual go fp16
    assert all(v.dtype == F32 for v in [*model.graph.inputs, *model.graph.outputs])
    casts = [n for n in model.graph if n.op_type == "Cast"]
    assert len(casts) == 4  # x, r in; o, h out


def test_fp32_precision_is_a_no_op() -> None:
    before = _block()
    model = ir.from_proto(before)
    report = optimize_model(model, PassConfig(target="tensorrt", precision="fp32"), {})
    assert report.fired("precision") == 0
    assert all(n.outputs[0].dtype == F32 for n in model.graph)


def test_rotary_angles_stay_fp32() -> None:
    before = onnx.parser.parse_model(fill(ROTARY, INV=floats(8, 5, 0.3, 1.0)))
    model = ir.from_proto(before)
    convert_precision(model, "fp16")
    t = _types(model)
    assert t["ang"] == F32 and t["c"] == F32  # integer-derived: computed in fp32
    pos = np.arange(3000, 3004, dtype=np.int64)[None]
    q = np.random.default_rng(0).standard_normal((1, 4, 8)).astype(np.float32)
    ref = _run(before, {"pos": pos, "q": q})[0]
    got = _run(ir.to_proto(model), {"pos": pos, "q": q.astype(np.float16)})[0].astype(np.float32)
    np.testing.assert_allclose(got, ref, atol=4e-3)  # angles rounded to fp16 (step 2 at 3000) would be off by ~1


def test_to_low_clips_to_finite_range() -> None:
    a = np.array([-3.4e38, 1e5, 0.1, np.inf], np.float32)
    assert to_low(a, F16).tolist() == [-65504.0, 65504.0, np.float16(0.1), np.inf]  # inf stays inf
    b = to_low(a, BF16)
    assert b.dtype == ml_dtypes.bfloat16 and np.isfinite(b[:3].astype(np.float32)).all()


def test_bad_keep_group_is_refused() -> None:
    with pytest.raises(ConfigError, match="keep_fp32"):
        PassConfig(precision="fp16", keep_fp32=("norms", "attention"))


@pytest.fixture(scope="module")
def llama_export(tiny_model_dir, tmp_path_factory):
    from trtinfer.export.onnx_export import export

    return whole_file(export(tiny_model_dir("llama"), tmp_path_factory.mktemp("onnx-llama-prec") / "x").onnx_path)


def _prefill(path, feeds_dtype, seq: int = 7):
    sess = ort.InferenceSession(str(path))
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(3, 300, (2, seq)).astype(np.int64),
             "position_ids": np.tile(np.arange(seq), (2, 1))}
    for i in sess.get_inputs():
        if i.name == "attention_mask":  # the concat KV layout (not the tensorrt pipeline's scatter_buffer)
            feeds[i.name] = np.ones((2, seq), np.int64)
        elif i.name.startswith("past"):  # empty, or a zeroed buffer of the graph's fixed slots (scatter_buffer)
            slots = i.shape[2] if isinstance(i.shape[2], int) else 0
            feeds[i.name] = np.zeros((2, i.shape[1], slots, i.shape[3]), feeds_dtype)
        elif i.name == "logits_positions":  # optimized graphs: the last position, which the export keeps
            feeds[i.name] = np.full((2, 1), seq - 1, np.int64)
    return sess.run(None, feeds)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_tensorrt_pipeline_low_precision(llama_export, tmp_path, precision: str) -> None:
    """Only TensorRT ops; logits close to fp32 (fp16 on ORT CPU; bf16 through the fp32 emulation)."""
    dst = tmp_path / "model.onnx"
    report = optimize(llama_export, dst, PassConfig(target="tensorrt", precision=precision))
    assert report.fired("precision") > 0
    model = ir.load(str(dst))
    assert {n.op_type for n in model.graph} <= TENSORRT_ONNX_OPS
    low = F16 if precision == "fp16" else BF16
    assert {v.dtype for v in model.graph.inputs if v.name.startswith("past")} == {low}
    assert next(v for v in model.graph.outputs if v.name == "logits").dtype == F32
    assert all(n.outputs[0].dtype == low for n in model.graph if n.op_type == "MatMul")
    assert all(n.outputs[0].dtype == F32 for n in model.graph if n.op_type in ("Softmax", "ReduceMean"))
    ref = _prefill(llama_export, np.float32)[0]
    if precision == "bf16":
        assert emulate_low_precision(model) > 0
        ir.save(model, str(tmp_path / "emulated.onnx"))
        got = _prefill(tmp_path / "emulated.onnx", np.float32)[0]
        tol = 8e-2
    else:
        got = _prefill(dst, np.float16)[0]
        tol = 1e-2
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(got - ref).max() <= tol * scale
    # the top-1 token agrees wherever the reference's top-2 margin exceeds twice the error
    diff = float(np.abs(got - ref).max())
    top2 = np.sort(ref, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * diff
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()
    if precision == "bf16":  # bf16 error is several times fp16's: the emulation really rounds
        f16 = optimize(llama_export, tmp_path / "f16.onnx", PassConfig(target="tensorrt", precision="fp16"))
        assert f16.fired("precision") > 0
        got16 = _prefill(tmp_path / "f16.onnx", np.float16)[0]
        assert np.abs(got - ref).max() > 2 * np.abs(got16 - ref).max()


def test_ort_pipeline_bf16_structure(llama_export, tmp_path) -> None:
    """ORT CUDA fp16/bf16 gets GroupQueryAttention on bf16 KV buffers; norms stay fp32."""
    dst = tmp_path / "model.onnx"
    report = optimize(llama_export, dst, PassConfig(target="onnxruntime-cuda", precision="bf16", max_seq_len=64))
    assert report.fired("attention") == 2 and report.fired("kv_share_buffer") == 1
    model = ir.load(str(dst))
    gqa = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and all(v.dtype == BF16 for n in gqa for v in n.inputs[:5] if v is not None)
    norms = [n for n in model.graph if "LayerNormalization" in n.op_type]
    assert norms and all(n.outputs[0].dtype == F32 for n in norms)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_fp16_engine_on_cpu(arch: str, tiny_engine) -> None:
    """fp16 engine: built-in check vs the export passes; KV fp16; greedy tokens equal the fp32 engine's."""
    eng16 = tiny_engine(arch, precision="fp16")
    m = json.loads((eng16 / "manifest.json").read_text())
    assert m["precision"] == "fp16" and m["engine_check"]["passed"] and m["engine_check"]["top1_agreement"] == 1.0
    assert 0 < m["engine_check"]["max_abs_diff"] <= 1e-2 * m["engine_check"]["logits_scale"]
    past = {t["dtype"] for t in m["io"]["inputs"] if t["name"].startswith("past")}
    assert past == {"float16"} and next(t for t in m["io"]["outputs"] if t["name"] == "logits")["dtype"] == "float32"
    prompts = ["The history of the city", "A quick brown fox jumps over"]
    with trtinfer.load(tiny_engine(arch)) as e32, trtinfer.load(eng16) as e16:
        a = [r.token_ids for r in e32.generate(prompts, max_new_tokens=8)]
        b = [r.token_ids for r in e16.generate(prompts, max_new_tokens=8)]
    assert a == b
    with trtinfer.load(eng16) as e16:  # fp16 KV rows: a ragged batch's row = that sequence in a cache of its own
        rows, alone = SlotCache(e16.session, 2, 8), SlotCache(e16.session, 1, 8)
        logits = rows.prefill_rows(0, [[5, 6, 7, 8], [9, 10]])
        np.testing.assert_allclose(alone.prefill(0, [9, 10]), logits[1], atol=1e-2)
        nxt = int(np.argmax(logits[1]))
        np.testing.assert_allclose(rows.decode({1: nxt})[1], alone.decode({0: nxt})[0], atol=1e-2)


def test_fp16_engine_keep_io_types(tiny_engine) -> None:
    m = json.loads((tiny_engine("llama", precision="fp16", keep_io_types=True) / "manifest.json").read_text())
    assert {t["dtype"] for t in m["io"]["inputs"] if t["name"].startswith("past")} == {"float32"}
    assert m["engine_check"]["passed"]


def test_bf16_cpu_build_is_refused() -> None:
    from trtinfer.builder import BuildConfig

    with pytest.raises(ConfigError, match="bf16 needs a GPU target"):
        BuildConfig(precision="bf16")
