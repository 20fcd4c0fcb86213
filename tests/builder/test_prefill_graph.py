"""``--prefill int8``: the int8 prefill graph's arithmetic, its place in an engine, the runtime's use of it, the build's
check and the refusals."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import trtinfer
from trtinfer.builder import BuildConfig
from trtinfer.builder.check import PREFILL_BOUND
from trtinfer.builder.config import PREFILL_GEMM_OPS
from trtinfer.errors import ConfigError
from trtinfer.runtime.config import RuntimeConfig


def _two_gemm_graph(path, w1: np.ndarray, w2: np.ndarray) -> None:
    """x [B,S,64] -> MatMul w1 [64,128] -> MatMul w2 [128,64] -> y: the second is the widest-K GEMM (a down projection)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", w1.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, None)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
                          "g", [x], [y, h], [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)


def test_int8_gemm_matches_per_token_arithmetic(tmp_path):
    """Each rewritten GEMM computes round(x/s)*s_token @ Wq*s_channel exactly as written out in numpy, stays within int8
    rounding of fp32 for rows of very different magnitudes, and the widest-K GEMM keeps its fp32 MatMul."""
    import onnxruntime as ort

    from trtinfer.builder.prefill_graph import PREFILL_NAME, write_prefill_graph

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 128)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((128, 64)).astype(np.float32) * 0.1
    _two_gemm_graph(tmp_path / "model.onnx", w1, w2)
    files = write_prefill_graph(tmp_path, "model.onnx", "fp32")
    assert files == {"prefill": PREFILL_NAME, "prefill_data": "prefill.onnx.data"}
    graph = onnx.load(str(tmp_path / PREFILL_NAME), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulInteger") == 1 and ops.count("MatMul") == 1  # w2 (K=128, the widest) kept
    used = {i for n in graph.node for i in n.input}
    assert "w1" not in {t.name for t in graph.initializer} and {t.name for t in graph.initializer} <= used
    # the kept weight is read from the decoder's data file, only the int8 weights are written anew
    where = {t.name: {e.key: e.value for e in t.external_data}.get("location")
             for t in graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert where["w2"] == "model.onnx.data" and {n for n, f in where.items() if f != "model.onnx.data"} == {
        n for n in where if n.startswith("prefill.")}
    assert (tmp_path / "prefill.onnx.data").stat().st_size == 64 * 128  # the int8 codes (its 128 scales are inline)

    x = rng.standard_normal((2, 5, 64)).astype(np.float32) * np.array([0.01, 1, 30, 0.5, 4], np.float32)[None, :, None]
    y, h = ort.InferenceSession(str(tmp_path / PREFILL_NAME), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    s = np.abs(x).max(-1, keepdims=True) / 127
    ws = np.abs(w1).max(0) / 127
    want_h = (np.clip(np.rint(x / s), -127, 127) @ np.clip(np.rint(w1 / ws), -127, 127)) * s * ws
    np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    exact = x @ w1
    rel = np.abs(h - exact).max(-1) / np.abs(exact).max(-1)  # per row: every magnitude keeps its precision
    assert rel.max() < 0.03, rel
    np.testing.assert_allclose(y, h @ w2, rtol=1e-4, atol=1e-4 * np.abs(y).max())


def test_head_adds_its_rounding_residual(tmp_path):
    """The LM head (the GEMM after the gather of the asked positions) computes its int8 product twice in one GEMM:
    each row's codes and the codes of its rounding residual at 1/254 of the scale, added up: exactly that arithmetic,
    its activations' rounding error under 2% of one pass of int8 codes'."""
    import onnxruntime as ort

    from trtinfer.builder.prefill_graph import PREFILL_NAME, write_prefill_graph

    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((64, 128)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((128, 64)).astype(np.float32) * 0.1  # the widest K: kept
    head = rng.standard_normal((64, 256)).astype(np.float32) * 0.1
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 64])
    pos = helper.make_tensor_value_info("pos", TensorProto.INT64, ["p"])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"]),
                           helper.make_node("Gather", ["y", "pos"], ["at"], axis=1),
                           helper.make_node("MatMul", ["at", "head"], ["logits"])],
                          "g", [x, pos], [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None),
                                          helper.make_tensor_value_info("at", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (head, "head"))])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    write_prefill_graph(tmp_path, "model.onnx", "fp32")
    ops = [n.op_type for n in onnx.load(str(tmp_path / PREFILL_NAME), load_external_data=False).graph.node]
    assert ops.count("MatMulInteger") == 2 and ops.count("Split") == 1  # w1, and the head once for both halves
    xs = rng.standard_normal((2, 6, 64)).astype(np.float32)
    logits, at = ort.InferenceSession(str(tmp_path / PREFILL_NAME), providers=["CPUExecutionProvider"]).run(
        None, {"x": xs, "pos": np.array([5, 2], np.int64)})
    assert logits.shape == (2, 2, 256)
    s = np.abs(at).max(-1, keepdims=True) / 127
    hs = np.abs(head).max(0) / 127
    wq = np.clip(np.rint(head / hs), -127, 127)
    hi = np.rint(at / s)
    lo = np.clip(np.rint((at / s - hi) * 254), -127, 127)
    want = (hi @ wq * s + lo @ wq * (s / 254)) * hs
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    exact = at @ (wq * hs)  # the activations' part of the error: against the int8 weights' exact product
    one_pass = (hi @ wq * s) * hs
    assert np.abs(logits - exact).max() < 0.02 * np.abs(one_pass - exact).max()


def _mlp_graph(path, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray, up_is_output: bool = False) -> None:
    """x -> gate, up (MatMul) -> m = sigmoid(gate) * up -> down (MatMul, the widest K) -> y: a gated MLP."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", wg.shape[0]])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", *(["u"] if up_is_output else []))]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("MatMul", ["x", "wu"], ["u"]),
                           helper.make_node("Sigmoid", ["g"], ["a"]), helper.make_node("Mul", ["a", "u"], ["m"]),
                           helper.make_node("MatMul", ["m", "wd"], ["y"])],
                          "g", [x], outs, [numpy_helper.from_array(a, n) for a, n in ((wg, "wg"), (wu, "wu"), (wd, "wd"))])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)


def _q8(a: np.ndarray, axis: int) -> np.ndarray:
    s = np.abs(a).max(axis, keepdims=True) / 127
    return np.clip(np.rint(a / s), -127, 127) * s


@pytest.mark.parametrize("folded", [True, False])
def test_down_projection_smoothed_into_int8(tmp_path, folded):
    """With statistics of its input, the down projection runs in int8 too, SmoothQuant's way: ``x / s`` (the division
    folded into the up projection's per-channel scales, free; an explicit Mul where the up projection's output is
    read elsewhere) times ``diag(s) W``, the strength the one of the grid nearest the float product on the sampled
    rows: exactly that arithmetic, and on activations with outlier channels nearer the fp32 product than the same
    GEMM without smoothing."""
    import onnx_ir as ir
    import onnxruntime as ort

    from trtinfer.builder.prefill_graph import int8_prefill
    from trtinfer.builder.prefill_smoothing import ALPHAS, InputStats, best_smoothing
    from trtinfer.quantization.smoothquant import smoothing_factors

    rng = np.random.default_rng(2)
    wg, wu = (rng.standard_normal((64, 128)).astype(np.float32) * 0.1 for _ in range(2))
    wu[:, [5, 40, 99]] *= 60  # outlier channels of the down projection's input
    wd = rng.standard_normal((128, 64)).astype(np.float32) * 0.1
    _mlp_graph(tmp_path / "model.onnx", wg, wu, wd, up_is_output=not folded)
    x = rng.standard_normal((1, 24, 64)).astype(np.float32)
    m = 1 / (1 + np.exp(-(x @ wg))) * (x @ wu)
    sample = m.reshape(-1, 128)[::3]
    stats = InputStats(np.abs(m).reshape(-1, 128).max(0), sample)
    s, alpha = best_smoothing(wd, stats)
    assert alpha in ALPHAS and alpha is not None and s is not None
    np.testing.assert_array_equal(s, smoothing_factors(stats.amax, np.abs(wd).max(1), alpha))
    errors = {}  # the search's own criterion, written out: squared error of the int8 product on the sampled rows
    for a in ALPHAS:
        sa = np.ones(128, np.float32) if a is None else smoothing_factors(stats.amax, np.abs(wd).max(1), a)
        errors[a] = float((((_q8(sample / sa, -1) @ _q8(wd * sa[:, None], 0)) - sample @ wd) ** 2).sum())
    assert errors[alpha] == pytest.approx(min(errors.values()), rel=1e-3) and errors[alpha] < errors[None]
    model = ir.load(tmp_path / "model.onnx")
    assert int8_prefill(model, ("MatMul",), {"m": stats}) == (3, [alpha])
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulInteger") == 3 and "MatMul" not in ops
    mul_count = ops.count("Mul")
    ir.save(model, tmp_path / "p.onnx")
    (y, *_) = ort.InferenceSession(str(tmp_path / "p.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    plain = ir.load(tmp_path / "model.onnx")
    assert int8_prefill(plain, ("MatMul",)) == (2, [])  # no statistics: the down projection keeps its MatMul
    # the down projection's epilogue (two Muls), and where 1/s could not be folded, the Mul dividing its input
    assert mul_count == [n.op_type for n in plain.graph].count("Mul") + 2 + (0 if folded else 1)
    xq = _q8(x, -1)
    gate = 1 / (1 + np.exp(-(xq @ _q8(wg, 0))))
    up = xq @ _q8(wu / s if folded else wu, 0)  # per-column scales: wu / s has wu's codes
    smoothed = gate * up if folded else (gate * up) / s
    want = _q8(smoothed, -1) @ _q8(wd * s[:, None], 0)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    m_q = gate * (xq @ _q8(wu, 0))  # the down projection's input as the int8 gate and up give it (= smoothed * s)
    exact = m_q @ wd
    unsmoothed = _q8(m_q, -1) @ _q8(wd, 0)
    assert np.abs(y - exact).max() < 0.5 * np.abs(unsmoothed - exact).max()


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_engine_with_prefill_graph(tiny_engine, precision):
    """The engine carries the graph and the build's check of it; passes of several tokens run on it (a prompt gives the
    same logits whole or in chunks), decode steps and draft verification on the decoder; its logits stay near the
    decoder's, and turning it off gives the decoder's exactly."""
    from trtinfer.runtime.slots import SlotCache

    path = tiny_engine("llama", precision=precision, prefill="int8")
    m = json.loads((path / "manifest.json").read_text())
    assert m["files"]["prefill"] == "prefill.onnx" and (path / "prefill.onnx.data").stat().st_size > 0
    check = m["prefill_check"]
    assert check["passed"] and check["ratio"] <= PREFILL_BOUND and check["tokens"] > 100, check
    # every GEMM in int8, the down projections smoothed with statistics of the calibration text
    assert len(check["down_projection_alphas"]) == m["geometry"]["num_layers"]
    ops = [n.op_type for n in onnx.load(str(path / "prefill.onnx"), load_external_data=False).graph.node]
    gemms = [n.op_type for n in onnx.load(str(path / "model.onnx"), load_external_data=False).graph.node
             if n.op_type in PREFILL_GEMM_OPS[precision]]
    assert not set(PREFILL_GEMM_OPS[precision]) & set(ops) and ops.count("MatMulInteger") == len(gemms) > 0
    assert m["build_config"]["prefill"] == "int8"
    prompt = list(range(3, 35))
    with trtinfer.load(path) as eng, trtinfer.load(path, RuntimeConfig(prefill_graph=False)) as plain:
        sess = eng.session
        assert sess.prefill_sess is not None and plain.session.prefill_sess is None
        # two sessions, one set of cores: neither's workers spin once its run is over; a lone decoder's do
        for s in (sess.sess, sess.prefill_sess):
            assert s.get_session_options().get_session_config_entry("session.force_spinning_stop") == "1"
        with pytest.raises(RuntimeError, match="does not have configuration"):
            plain.session.sess.get_session_options().get_session_config_entry("session.force_spinning_stop")
        assert sess.session_for({"input_ids": np.zeros((1, 2), np.int64)}) is sess.prefill_sess
        assert sess.session_for({"input_ids": np.zeros((4, 1), np.int64)}) is sess.sess  # decode steps
        with sess.decoder_graph():
            assert sess.session_for({"input_ids": np.zeros((1, 5), np.int64)}) is sess.sess
        a, b = (SlotCache(x, 1, 128).prefill(0, prompt) for x in (sess, plain.session))
        assert not np.array_equal(a, b)  # the int8 graph ran ...
        assert np.abs(a - b).max() < 0.05 * max(1.0, np.abs(b).max())  # ... and stays near the decoder's logits
        # chunks: the same KV and logits as the prompt in one pass (activations are quantized token by token)
        cache = SlotCache(sess, 1, 64)
        cache.prefill(0, prompt[:20])
        chunked = cache.prefill(0, prompt[20:])
        np.testing.assert_allclose(chunked, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
        # a draft's verification scores as decode steps: the logits the decoder gives one token at a time
        steps = SlotCache(sess, 1, 64)
        steps.prefill(0, prompt)
        one_by_one = np.stack([steps.prefill(0, [t]) for t in (7, 8, 9)])
        verified = cache.prefill(0, [7, 8, 9], every=True)
        np.testing.assert_allclose(verified, one_by_one, rtol=1e-4, atol=1e-4 * np.abs(one_by_one).max())
        out = eng.generate(input_ids=[prompt], max_new_tokens=6, min_new_tokens=6)
        assert len(out[0].token_ids) == 6


@pytest.mark.slow
def test_real_model_smoothed_and_the_fallback(real_engine, in_user_cache, tmp_path, monkeypatch):
    """SmolLM2 int4: every down projection in int8, smoothed at a strength of the grid chosen per layer, within the
    bound. A graph the check refuses with them in int8 (only an absurd strength to choose from) is written again with
    the down projections on the decoder's kernel, checked again, and the build succeeds with that graph."""
    from trtinfer.builder import build, prefill_smoothing

    m = json.loads((real_engine("smollm2-135m", precision="int4", prefill="int8") / "manifest.json").read_text())
    check = m["prefill_check"]
    alphas = check["down_projection_alphas"]
    assert check["passed"] and len(alphas) == m["geometry"]["num_layers"] == 30, check
    assert set(alphas) <= set(prefill_smoothing.ALPHAS) and len(set(alphas)) > 1  # not one strength for all layers
    monkeypatch.setattr(prefill_smoothing, "ALPHAS", (6.0,))
    with in_user_cache():
        path = build("smollm2-135m", tmp_path / "e", BuildConfig(prefill="int8"), progress=False)
    check = json.loads((path / "manifest.json").read_text())["prefill_check"]
    assert check["down_projection_alphas"] == [] and \
        check["ratio_with_int8_down_projections"] > PREFILL_BOUND >= check["ratio"], check
    ops = [n.op_type for n in onnx.load(str(path / "prefill.onnx"), load_external_data=False).graph.node]
    assert ops.count("MatMul") == 30  # the down projections, on the decoder's fp32 kernel


def test_cli_turns_the_prefill_graph_off(tiny_engine, tmp_path, capsys):
    """``--no-prefill-graph`` (eval, generate, serve): every pass on the decoder graph: eval scores the decoder's
    perplexity, not the prefill graph's; serve's setting reaches the engine's runtime config."""
    from trtinfer.cli import main
    from trtinfer.cli.serve import add_parser, config_from_args

    path = tiny_engine("llama", precision="fp32", prefill="int8")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12, encoding="utf-8")
    got = {}
    for flag in ("--prefill-graph", "--no-prefill-graph"):
        assert main(["eval", str(path), "--text-file", str(text), "--json", flag]) == 0
        got[flag] = json.loads(capsys.readouterr().out)["perplexity"]
    with trtinfer.load(path, RuntimeConfig(prefill_graph=False)) as plain:
        decoder = plain.perplexity(text.read_text(encoding="utf-8")).perplexity
    assert got["--no-prefill-graph"] == pytest.approx(decoder, rel=1e-6)
    assert got["--prefill-graph"] != pytest.approx(decoder, rel=1e-6)
    assert main(["generate", str(path), "--prompt", "hi", "--max-new-tokens", "3", "--no-prefill-graph"]) == 0
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    for argv, want in ((["serve", "E"], True), (["serve", "E", "--no-prefill-graph"], False)):
        args = sub.choices["serve"].parse_args(argv[1:])
        assert config_from_args(args).runtime().prefill_graph is want


def test_prefill_refused_where_it_has_no_meaning(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="--prefill must be one of int8"):
        BuildConfig(prefill="fp8")
    with pytest.raises(ConfigError, match="ONNX Runtime CPU engines"):
        BuildConfig(precision="fp16", prefill="int8")
    with pytest.raises(ConfigError, match="ONNX Runtime CPU engines"):
        BuildConfig(target="cuda", prefill="int8")
    from trtinfer.cli import main

    out = tmp_path / "e"
    assert main(["build", str(tiny_model_dir("llama")), "-o", str(out), "--prefill", "int9"]) == 2
    assert not out.exists()
    with pytest.raises(ConfigError, match="prefill_graph must be True or False"):
        RuntimeConfig(prefill_graph="yes")  # type: ignore[arg-type]
    from trtinfer.serving.config import ServeConfig

    with pytest.raises(ConfigError, match="prefill_graph must be True or False"):
        ServeConfig(prefill_graph=1)  # type: ignore[arg-type]


def test_prefill_graph_only_where_the_int8_gemm_is_exact():
    """x86 without VNNI (AVX2's saturating pair adds) runs prompts on the decoder; VNNI/AMX or ARM use the graph."""
    from trtinfer.runtime.ort_env import u8s8_exact

    assert not u8s8_exact("x86_64", {"avx", "avx2", "fma", "avx512f", "avx512bw"})
    assert u8s8_exact("x86_64", {"avx2", "avx_vnni"}) and u8s8_exact("x86_64", {"avx512f", "avx512_vnni"})
    assert u8s8_exact("aarch64", set())


def test_inspect_shows_the_prefill_check(tiny_engine, capsys):
    from trtinfer.cli import main

    path = tiny_engine("llama", precision="int4", prefill="int8")
    assert main(["inspect", str(path)]) == 0
    ratio = json.loads((path / "manifest.json").read_text())["prefill_check"]["ratio"]
    out = capsys.readouterr().out
    assert f"int8 prefill graph: held-out perplexity x{ratio:.3f} of the decoder graph's alone" in out
    assert "; down projections in int8 (" in out
