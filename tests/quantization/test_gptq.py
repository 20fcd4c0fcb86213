"""GPTQ block quantization: lower output error than round-to-nearest on correlated inputs, MatMulNBits' layout."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtinfer.errors import ConfigError
from trtinfer.quantization.blocks import quantize_rtn, unpack_codes
from trtinfer.quantization.gptq import HessianAccumulator, factor, gptq_quantize, weighted_error


def correlated(k: int, rows: int, seed: int = 0) -> np.ndarray:
    """Activations ``X = Z A`` with a random mixing ``A`` and a few channels of much larger scale."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(k, k)) / np.sqrt(k)
    x = rng.normal(size=(rows, k)) @ a
    x[:, rng.choice(k, k // 16, replace=False)] *= 20.0
    return x.astype(np.float32)


def hessian_of(x: np.ndarray) -> np.ndarray:
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x[: len(x) // 2].reshape(2, -1, x.shape[-1]))  # leading axes are rows too
    acc.add(x[len(x) // 2:])
    return acc.hessian()


def output_error(x: np.ndarray, w: np.ndarray, q: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return float(np.sum((x64 @ w - x64 @ q) ** 2))


@pytest.fixture(scope="module")
def layer() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k, n = 256, 96
    x = correlated(k, 2048)
    w = np.random.default_rng(1).normal(size=(k, n)).astype(np.float32)
    return x, w, hessian_of(x)


def test_hessian_accumulator_sums_rows() -> None:
    x = np.random.default_rng(2).normal(size=(3, 5, 8)).astype(np.float32)
    acc = HessianAccumulator(8)
    acc.add(x[:1])
    acc.add(x[1:])
    x2 = x.reshape(-1, 8).astype(np.float64)
    assert acc.rows == 15
    with pytest.raises(ValueError, match="8 features"):
        acc.add(np.zeros((2, 7), np.float32))
    np.testing.assert_allclose(acc.hessian(), 2 * x2.T @ x2 / 15, rtol=1e-5)  # float32, as the GPTQ reference
    with pytest.raises(ValueError, match="already called"):  # the accumulator became the Hessian
        acc.add(x[:1])


def test_hessian_accumulator_buffers_rows() -> None:
    """Single rows (decode steps) are gathered and added FLUSH_ROWS at a time; the sum is the same."""
    x = np.random.default_rng(3).normal(size=(2 * HessianAccumulator.FLUSH_ROWS + 7, 16)).astype(np.float32)
    acc = HessianAccumulator(16)
    for row in x:
        acc.add(row[None])
    assert acc.rows == len(x)  # two flushes so far, 7 rows waiting: hessian() adds them
    x64 = x.astype(np.float64)
    h = acc.hessian()
    np.testing.assert_allclose(h, 2 * x64.T @ x64 / len(x), rtol=1e-4, atol=1e-5)
    assert np.array_equal(h, h.T)  # the rank-k updates fill one triangle; hessian() mirrors it exactly
    with pytest.raises(ValueError, match="no activations"):
        HessianAccumulator(4).hessian()


@pytest.mark.parametrize("kw", [{}, {"act_order": True}, {"scale_search": True}, {"block": 64}],
                         ids=["plain", "act_order", "scale_search", "block64"])
def test_gptq_beats_rtn_on_correlated_inputs(layer, kw) -> None:
    x, w, h = layer
    block = kw.get("block", 32)
    rtn = quantize_rtn(w, 4, block, symmetric=True)
    q = gptq_quantize(w, h, **kw)
    e_rtn = output_error(x, w, rtn.dequantize())
    e_gptq = output_error(x, w, q.dequantize())
    assert e_gptq < 0.8 * e_rtn, (kw, e_gptq / e_rtn)
    # the proxy loss is the same ratio, normalised
    ref = float(np.sum((x.astype(np.float64) @ w) ** 2))
    assert weighted_error(w, q, h) == pytest.approx(e_gptq / ref, rel=1e-3)


@pytest.mark.parametrize("bits", [4, 8])
def test_layout_is_symmetric_matmulnbits(layer, bits) -> None:
    _, w, h = layer
    q = gptq_quantize(w, h, bits=bits, block=32, act_order=True)
    k, n = w.shape
    assert q.zero_points is None and q.symmetric
    assert q.codes.shape == (n, k) and q.codes.dtype == np.uint8
    assert q.scales.shape == (n, k // 32) and q.scales.dtype == np.float32
    assert int(q.codes.max()) <= (1 << bits) - 1
    packed = q.packed()
    assert packed.shape == (n, k // 32, 32 * bits // 8)
    np.testing.assert_array_equal(unpack_codes(packed, bits), q.codes)


def test_asymmetric_has_zero_points(layer) -> None:
    x, w, h = layer
    q = gptq_quantize(w, h, symmetric=False)
    assert q.zero_points is not None and q.zero_points.shape == q.scales.shape
    assert int(q.zero_points.max()) <= 15 and int(q.codes.max()) <= 15
    rtn = quantize_rtn(w, 4, 32, symmetric=False)
    assert output_error(x, w, q.dequantize()) < 0.8 * output_error(x, w, rtn.dequantize())


def test_identity_hessian_is_round_to_nearest(layer) -> None:
    _, w, _ = layer
    k = w.shape[0]
    for symmetric in (True, False):
        rtn = quantize_rtn(w, 4, 32, symmetric=symmetric)
        q = gptq_quantize(w, np.eye(k), symmetric=symmetric)
        np.testing.assert_array_equal(q.scales, rtn.scales)
        assert np.mean(q.codes == rtn.codes) > 0.999  # float ties may round either way


def test_dead_input_columns(layer) -> None:
    x, w, _ = layer
    x = x.copy()
    dead = [0, 5, 100, 255]
    x[:, dead] = 0.0
    h = hessian_of(x)
    q = gptq_quantize(w, h, act_order=True)
    deq = q.dequantize()
    assert np.all(np.isfinite(deq))
    # dead rows keep their weights (rounded plainly), so inputs calibration never saw still work
    rtn = quantize_rtn(w, 4, 32).dequantize()
    np.testing.assert_array_equal(deq[dead], rtn[dead])
    assert output_error(x, w, deq) < 0.8 * output_error(x, w, rtn)


def test_all_zero_and_rank_deficient_hessians() -> None:
    w = np.random.default_rng(3).normal(size=(64, 16)).astype(np.float32)
    q = gptq_quantize(w, np.zeros((64, 64)))
    np.testing.assert_array_equal(q.dequantize(), quantize_rtn(w, 4, 32).dequantize())
    x = np.random.default_rng(4).normal(size=(8, 64)).astype(np.float32)  # 8 rows: rank 8 < 64
    q = gptq_quantize(w, hessian_of(x), percdamp=0.0)
    assert np.all(np.isfinite(q.dequantize()))


def test_bad_layouts_raise() -> None:
    w = np.zeros((80, 8), np.float32)
    with pytest.raises(ConfigError, match="does not divide"):
        gptq_quantize(w, np.eye(80), block=32)
    with pytest.raises(ConfigError, match="bits"):
        gptq_quantize(np.zeros((64, 8), np.float32), np.eye(64), bits=3)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(np.zeros((64, 8), np.float32), np.eye(32))


def test_matmulnbits_computes_the_dequantized_product(layer) -> None:
    x, w, h = layer
    k, n = w.shape
    q = gptq_quantize(w, h, block=32, scale_search=True)
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=32, accuracy_level=0)
    graph = helper.make_graph(
        [node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["m", n])],
        initializer=[numpy_helper.from_array(q.packed(), "B"),
                     numpy_helper.from_array(q.scales.reshape(-1), "scales")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = x[:16] / np.abs(x[:16]).max()
    y = sess.run(["Y"], {"A": a})[0]
    np.testing.assert_allclose(y, a @ q.dequantize(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_in_column_chunks_equals_whole(symmetric, monkeypatch):
    """Round-to-nearest quantizes a chunk of output columns at a time (bounded temporaries for a 128k-vocabulary
    LM head); the result is the whole-matrix quantization's, codes, scales and zero points."""
    from trtinfer.quantization import blocks

    w = np.random.default_rng(3).standard_normal((256, 1000)).astype(np.float32)
    whole = quantize_rtn(w, 4, 32, symmetric=symmetric)
    monkeypatch.setattr(blocks, "RTN_CHUNK_ELEMENTS", 256 * 7)  # 7 columns a chunk: 143 chunks, a ragged last one
    chunked = blocks.quantize_rtn(w, 4, 32, symmetric=symmetric)
    assert np.array_equal(whole.codes, chunked.codes) and np.array_equal(whole.scales, chunked.scales)
    assert (whole.zero_points is None) == symmetric and (symmetric or np.array_equal(whole.zero_points,
                                                                                     chunked.zero_points))


@pytest.mark.parametrize("act_order", [False, True])
def test_factor_is_the_inverse_cholesky_in_float32(layer, act_order) -> None:
    """U^T U = (P^T H P + λI)^-1 with U upper, in the visiting order; a weight quantized with the factor made once
    equals one quantized from H (q/k/v share one factor)."""
    _, w, h = layer
    k = h.shape[0]
    f = factor(h, act_order=act_order)
    assert f.u.dtype == np.float32 and np.array_equal(np.triu(f.u), f.u)
    if act_order:
        assert np.all(np.diff(np.diag(h)[f.perm]) <= 0)  # decreasing diag H
    else:
        np.testing.assert_array_equal(f.perm, np.arange(k))
    hp = h.astype(np.float64)[np.ix_(f.perm, f.perm)] + 0.01 * float(np.diag(h).mean()) * np.eye(k)
    inverse = np.linalg.inv(hp)
    u = f.u.astype(np.float64)
    assert np.abs(u.T @ u - inverse).max() < 1e-4 * np.abs(inverse).max()
    np.testing.assert_array_equal(gptq_quantize(w, f, act_order=act_order).dequantize(),
                                  gptq_quantize(w, h, act_order=act_order).dequantize())
    with pytest.raises(ValueError, match="act_order"):
        gptq_quantize(w, f, act_order=not act_order)


def test_a_singular_hessian_gets_more_damping(caplog) -> None:
    x = np.random.default_rng(4).normal(size=(8, 64)).astype(np.float32)  # rank 8 < 64
    with caplog.at_level("DEBUG", logger="trtinfer.quantization.gptq"):
        f = factor(hessian_of(x), percdamp=0.0)
    assert "doubling it" in caplog.text  # the first factorization failed and the matrix was restored
    assert np.all(np.isfinite(f.u)) and np.array_equal(np.triu(f.u), f.u) and np.all(np.diag(f.u) > 0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_a_chunk_of_columns_at_a_time(layer, monkeypatch, act_order) -> None:
    """Each output column is quantized alone: chunks of 7 columns give the codes of the whole weight."""
    from trtinfer.quantization import gptq

    _, w, h = layer
    k, n = w.shape
    whole = gptq_quantize(w, h, act_order=act_order, scale_search=True)
    monkeypatch.setattr(gptq, "GPTQ_CHUNK_ELEMENTS", 7 * k)
    read: list[tuple[int, int]] = []

    def columns(a: int, b: int) -> np.ndarray:
        read.append((a, b))
        return w[:, a:b]

    parts = gptq.gptq_columns(columns, k, n, factor(h, act_order=act_order), act_order=act_order, scale_search=True)
    assert read[0] == (0, 7) and read[-1][1] == n and len(read) == -(-n // 7)
    assert np.mean(parts.codes == whole.codes) > 0.999  # GEMMs of another width may round a rare code the other way
    np.testing.assert_allclose(parts.scales, whole.scales, rtol=1e-5)


@pytest.mark.parametrize("symmetric", [True, False])
def test_spilled_blocks_read_back_what_was_written(layer, tmp_path, symmetric) -> None:
    """GPTQ's blocks wait on disk until the stage is written: the file gives back the same codes, scales and zero
    points, and the same MatMulNBits inputs."""
    from trtinfer.quantization.weights import BlockCache, SpilledBlocks

    _, w, h = layer
    q = gptq_quantize(w, h, symmetric=symmetric)
    spilled = SpilledBlocks(q, tmp_path, BlockCache())
    back = spilled.compute()
    np.testing.assert_array_equal(back.codes, q.codes)
    np.testing.assert_array_equal(back.scales, q.scales)
    assert (back.zero_points is None) == symmetric == spilled.symmetric
    if not symmetric:
        np.testing.assert_array_equal(back.zero_points, q.zero_points)
    np.testing.assert_array_equal(spilled.packed().numpy(), q.packed())
    assert (spilled.k, spilled.n, spilled.bits, spilled.block) == (q.k, q.n, q.bits, q.block)
    assert [p.suffix for p in tmp_path.iterdir()] == [".npz"]


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-point"])
def test_scale_search_picks_each_columns_least_weighted_error(symmetric: bool) -> None:
    """The search over one block (``rows [block, N]``, worked in place) returns, per column, the candidate scale
    ``s·f`` whose weighted squared rounding error is least, as a per-column loop in float64 finds it."""
    from trtinfer.quantization.blocks import rtn_params
    from trtinfer.quantization.gptq import SCALE_FACTORS, _search

    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((32, 64)) * rng.random(64) * 0.05).astype(np.float32)
    rows[:, 5] = 0.0  # an all-zero column keeps its zero scale
    weights = rng.random(32).astype(np.float32) * 4
    s, z = rtn_params(rows.min(axis=0), rows.max(axis=0), 4, symmetric)
    got_s, got_z = _search(rows, weights, s, z, 4, symmetric)
    assert got_s.dtype == np.float32 and got_s.shape == (64,) and got_s[5] == 0.0
    for col in range(64):
        candidates = []  # (loss in float64, scale, zero point) per factor
        for f in SCALE_FACTORS:
            sf = np.float32(s[col] * f)
            safe = sf if sf else np.float32(1.0)
            zf = np.float32(8.0) if symmetric else np.float32(np.clip(np.rint(z[col] * s[col] * f / safe), 0, 15))
            q = (np.clip(np.rint(rows[:, col] / safe) + zf, 0, 15) - zf) * sf
            candidates.append((float(np.sum((rows[:, col].astype(np.float64) - q) ** 2 * weights)), sf, zf))
        least = min(loss for loss, _, _ in candidates)
        chosen = [(loss, zf) for loss, sf, zf in candidates if sf == got_s[col]]
        assert chosen and chosen[0][0] <= least * (1 + 1e-5), (col, chosen, least)
        if not symmetric:
            assert got_z is not None and got_z[col] == chosen[0][1]
