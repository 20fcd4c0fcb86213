"""The quantize stage on tiny models: what each precision writes, the stage record, builds from it, errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from trtinfer.artifact import read_stage
from trtinfer.errors import ConfigError
from trtinfer.quantization import QuantConfig, quantize_cached, quantize_stage


@pytest.fixture(scope="module")
def stages(tiny_model_dir, tmp_path_factory):
    """``stages(arch)`` -> (export stage, fp32 optimize stage for onnxruntime-cpu)."""
    from trtinfer.export import export
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_stage

    made = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"q-{arch}")
            exp = export(tiny_model_dir(arch), root / "exp")
            opt = optimize_stage(exp, root / "opt", PassConfig(max_seq_len=256))
            made[arch] = (exp, opt)
        return made[arch]

    return get


def graph(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path / "model.onnx"), load_external_data=False)


def ops(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op]


def attr(node: onnx.NodeProto, name: str) -> int:
    return next(onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def float_weight_matmuls(model: onnx.ModelProto) -> list[str]:
    from trtinfer.stage_weights import checkpoint_inputs

    inits = {i.name for i in model.graph.initializer} | checkpoint_inputs(model)
    return [n.name for n in ops(model, "MatMul") if n.input[1] in inits]


def engine_logits(engine: Path, ids: list[list[int]]) -> np.ndarray:
    from trtinfer.runtime import Engine

    with Engine(engine) as eng:
        return np.stack([r.logprobs for r in eng.score(input_ids=ids)])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int4_rtn_replaces_every_weight_matmul(stages, arch, tmp_path):
    _, opt = stages(arch)
    before = float_weight_matmuls(graph(opt.path))
    q = quantize_stage(opt, tmp_path / "q", QuantConfig(precision="int4", method="rtn"), progress=False)
    m = graph(q.path)
    nbits = ops(m, "MatMulNBits")
    rep = q.history["quantize"]["report"]
    assert float_weight_matmuls(m) == [] and rep["quantized"] == len(before)
    # q/k/v and gate/up read one input each: packed into one MatMulNBits per group
    layers = opt.geometry["num_layers"]
    gqa = ops(m, "GroupQueryAttention")
    if arch == "llama":  # q/k/v feed attention directly: packed QKV (Gemma-3 normalizes q and k first)
        assert rep["packing"]["packed_qkv_attention"] == layers and all(g.input[1] == "" for g in gqa)
        assert len(nbits) == 4 * layers + 1
    assert rep["packing"]["matmuls_packed"] >= 2 * layers
    assert all(attr(n, "accuracy_level") == 4 and attr(n, "block_size") == 32 for n in nbits)
    head = [n for n in nbits if attr(n, "N") == opt.geometry["vocab_size"]]
    assert len(head) == 1 and attr(head[0], "bits") == 4  # the LM head takes 4 bits by default
    assert sorted({attr(n, "bits") for n in nbits}) == [4]
    q8 = quantize_stage(opt, tmp_path / "q8", QuantConfig(precision="int4", method="rtn", lm_head_bits=8),
                        progress=False)
    head8 = [n for n in ops(graph(q8.path), "MatMulNBits") if attr(n, "N") == opt.geometry["vocab_size"]]
    assert attr(head8[0], "bits") == 8
    assert all(len(n.input) == 3 for n in nbits)  # symmetric: no zero points
    rec = q.history["quantize"]
    assert q.stage == "quantize" and rec["config"]["precision"] == "int4" and rec["report"]["quantized"] == len(before)
    acc = rec["accuracy"]
    assert acc["tokens"] > 100 and np.isfinite(acc["perplexity"]) and 0 <= acc["top1_agreement"] <= 1
    assert read_stage(q.path).stage == "quantize"  # files verified against the record


def test_tied_embedding_shares_the_lm_head_blocks(stages, tmp_path):
    _, opt = stages("gemma3")  # Gemma-3 ties its embeddings
    q = quantize_stage(opt, tmp_path / "q", QuantConfig(precision="int4", method="rtn"), progress=False)
    m = graph(q.path)
    gbq = ops(m, "GatherBlockQuantized")
    head = [n for n in ops(m, "MatMulNBits") if attr(n, "N") == opt.geometry["vocab_size"]]
    tables = {i.name for i in m.graph.initializer if list(i.dims[:1]) == [opt.geometry["vocab_size"]]}
    assert len(gbq) == 1 and not [n for n in ops(m, "Gather") if n.input[0] in tables]  # no fp32 table left
    assert gbq[0].input[0] == head[0].input[1]  # one stored copy of the table
    assert q.history["quantize"]["report"]["tied_embedding"] is True
    # 8-bit blocks of the tied table: the model still predicts as the fp32 one does on most positions
    assert q.history["quantize"]["accuracy"]["top1_agreement"] > 0.5


def test_int8_engine_stays_close_to_fp32(stages, tmp_path):
    from trtinfer.builder import BuildConfig, build

    _, opt = stages("llama")
    q = quantize_stage(opt, tmp_path / "q", QuantConfig(precision="int8"), progress=False)
    assert {attr(n, "bits") for n in ops(graph(q.path), "MatMulNBits")} == {8}
    e8 = build(q.path, tmp_path / "e8", BuildConfig(precision="int8"), progress=False)
    e32 = build(opt.path, tmp_path / "e32", BuildConfig(), progress=False)
    m = json.loads((e8 / "manifest.json").read_text())
    assert m["precision"] == "int8" and m["engine_check"]["passed"]
    assert m["quantization"]["accuracy"]["ratio"] == q.history["quantize"]["accuracy"]["ratio"]
    ids = [list(range(5, 60))]
    lp8, lp32 = engine_logits(e8, ids), engine_logits(e32, ids)
    assert np.abs(lp8 - lp32).max() < 0.1  # 8-bit weights + int8 activations: log-probs within 0.1 nats
    assert q.history["quantize"]["accuracy"]["top1_agreement"] > 0.9


def test_gptq_uses_calibration_statistics(stages, tmp_path):
    from trtinfer.calibration import CalibrationConfig

    _, opt = stages("llama")
    cal = CalibrationConfig(num_samples=4, seq_len=32, decode_steps=2)
    q = quantize_stage(opt, tmp_path / "q", QuantConfig(precision="int4", method="gptq", calibration=cal),
                       progress=False)
    rep = q.history["quantize"]["report"]
    assert rep["method"] == "gptq" and rep["calibration"]["samples"] == 4
    assert rep["calibration"]["runs"] == 4 * 3  # each window: one prefill + two decode steps
    assert q.history["quantize"]["config"]["calibration"]["num_samples"] == 4


def test_keep_fp32_and_include_patterns(stages, tmp_path):
    _, opt = stages("gemma3")
    vocab = opt.geometry["vocab_size"]
    q = quantize_stage(opt, tmp_path / "a", QuantConfig(precision="int4", method="rtn", keep_fp32=("lm_head",)),
                       progress=False)
    m = graph(q.path)
    assert len(float_weight_matmuls(m)) == 1 and ops(m, "GatherBlockQuantized") == []  # head and table stay fp32
    assert all(attr(n, "N") != vocab for n in ops(m, "MatMulNBits"))
    q2 = quantize_stage(opt, tmp_path / "b", QuantConfig(precision="int4", method="rtn", include=("*mlp*",)),
                        progress=False)
    names = [n.name for n in ops(graph(q2.path), "MatMulNBits")]
    assert names and all("mlp" in n for n in names)
    assert all("mlp" not in k for k in q2.history["quantize"]["report"]["kept"])


def test_quantize_refuses_what_it_cannot_take(stages, tmp_path):
    from trtinfer.builder import BuildConfig, build

    exp, opt = stages("llama")
    with pytest.raises(ConfigError, match="trtinfer optimize"):
        quantize_stage(exp, tmp_path / "x", QuantConfig(precision="int4", method="rtn"), progress=False)
    q = quantize_stage(opt, tmp_path / "q", QuantConfig(precision="int4", method="rtn"), progress=False)
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_stage(q, tmp_path / "y", QuantConfig(precision="int8"), progress=False)
    with pytest.raises(ConfigError, match="--precision int4"):
        build(q.path, tmp_path / "e", BuildConfig(), progress=False)
    with pytest.raises(ConfigError, match="not available for no-such-target"):
        from trtinfer.quantization.registry import get_precision

        get_precision("int4", "no-such-target")
    with pytest.raises(ConfigError, match="power of 2"):
        QuantConfig(block_size=48)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_quantize_cached_reuses_the_entry(stages):
    _, opt = stages("llama")
    cfg = QuantConfig(precision="int4", method="rtn")
    first, second = {}, {}
    a = quantize_cached(opt, cfg, stats=first, progress=False)
    b = quantize_cached(opt, cfg, stats=second, progress=False)
    assert first["cached"] is False and second["cached"] is True and a.path == b.path


def run_cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trtinfer", *map(str, args)], check=False, capture_output=True,
                          text=True)


def test_cli_quantize_build_inspect(stages, tmp_path):
    _, opt = stages("llama")
    r = run_cli("quantize", opt.path, "-o", tmp_path / "q", "--precision", "int4", "--method", "rtn")
    assert r.returncode == 0, r.stderr
    assert "int4 (rtn)" in r.stdout and "perplexity" in r.stdout and "top-1 agreement" in r.stdout
    r = run_cli("build", tmp_path / "q", "-o", tmp_path / "e", "--precision", "int4")
    assert r.returncode == 0, r.stderr
    assert "quantized: int4 (rtn)" in r.stdout and "engine check vs int4 quantize-stage graph" in r.stdout
    r = run_cli("inspect", tmp_path / "e")
    assert "quantized    int4" in r.stdout and "accuracy     on" in r.stdout
    r = run_cli("quantize", opt.path, "-o", tmp_path / "z", "--precision", "int4", "--block-size", "48")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--block-size" in r.stderr
    assert not (tmp_path / "z").exists()


def test_int8_static_calibration_cache_is_reused(stages, tmp_path):
    """A second int8-static quantize given the first one's calibration file reuses its scales bit for bit."""
    _, opt = stages("llama")
    r = run_cli("quantize", opt.path, "-o", tmp_path / "a", "--precision", "int8-static",
                "--calibration-samples", "4", "--calibration-seq-len", "32", "--calibration-decode-steps", "2")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "a" / "calibration.json").is_file() and (tmp_path / "a" / "calibration.cache").is_file()
    header = (tmp_path / "a" / "calibration.cache").read_text().splitlines()[0]
    assert header.startswith("TRT-") and header.endswith("Calibration")
    r = run_cli("quantize", opt.path, "-o", tmp_path / "b", "--precision", "int8-static",
                "--calibration-cache", tmp_path / "a" / "calibration.json", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["report"]["calibration"]["reused"] is True
    a, b = read_stage(tmp_path / "a"), read_stage(tmp_path / "b")
    assert a.history["quantize"]["report"]["calibration"]["reused"] is False

    def scales(path: Path) -> dict[str, np.ndarray]:
        m = onnx.load(str(path / "model.onnx"))
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
        return {n.input[1]: inits[n.input[1]] for n in m.graph.node if n.op_type == "QuantizeLinear"}

    sa, sb = scales(a.path), scales(b.path)
    assert sa and sa.keys() == sb.keys() and all(np.array_equal(sa[k], sb[k]) for k in sa)
    # bad calibration data: one line, exit 2, nothing written
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = run_cli("quantize", opt.path, "-o", tmp_path / "c", "--precision", "int8-static", "--calibration-data", empty)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "empty" in r.stderr and not (tmp_path / "c").exists()


def test_weights_quantized_while_written_equal_blocks_of_the_checkpoint(stages, tiny_model_dir, tmp_path):
    """Round-to-nearest blocks are computed as the stage is written, from the checkpoint's own tensors: each packed
    weight, the packed QKV (three weights stacked) and the untied embedding table's GatherBlockQuantized are exactly
    :func:`quantize_rtn` of the checkpoint tensor; and the stage holds no fp32 copy of any of them."""
    from onnx import numpy_helper
    from safetensors.numpy import load_file

    from trtinfer.quantization.blocks import quantize_rtn
    from trtinfer.stage_weights import checkpoint_inputs

    _, opt = stages("llama")
    q = quantize_stage(opt, tmp_path / "q", QuantConfig(precision="int4", method="rtn"), progress=False)
    m = onnx.load(str(q.path / "model.onnx"))  # with its weights
    assert not checkpoint_inputs(m)  # a quantize stage refers to no checkpoint
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    ckpt = load_file(str(tiny_model_dir("llama") / "model.safetensors"))
    by_name = {n.name: n for n in m.graph.node}

    def blocks(tensor: str, bits: int = 4):
        return quantize_rtn(np.ascontiguousarray(ckpt[tensor].astype(np.float32).T), bits, 32, True)

    down = by_name["/model/model/layers.1/mlp/down_proj/MatMul_Q4"]
    want = blocks("model.layers.1.mlp.down_proj.weight")
    np.testing.assert_array_equal(inits[down.input[1]], want.packed())
    np.testing.assert_array_equal(inits[down.input[2]], want.flat_scales())
    qkv = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and "layers.0/self_attn/q_proj" in n.name)
    parts = [blocks(f"model.layers.0.self_attn.{p}_proj.weight") for p in "qkv"]
    np.testing.assert_array_equal(inits[qkv.input[1]], np.concatenate([b.packed() for b in parts]))
    np.testing.assert_array_equal(inits[qkv.input[2]], np.concatenate([b.flat_scales() for b in parts]))
    gather = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    table = quantize_rtn(np.ascontiguousarray(ckpt["model.embed_tokens.weight"].astype(np.float32).T), 4, 32, True)
    np.testing.assert_array_equal(inits[gather.input[0]], table.packed())
    np.testing.assert_array_equal(inits[gather.input[2]], table.gather_scales())
    assert not any(v.dtype == np.float32 and v.size >= 64 * 64 for v in inits.values())  # no fp32 matrix is left
    assert q.history["quantize"]["report"]["embedding"].startswith("GatherBlockQuantized, 4-bit")
