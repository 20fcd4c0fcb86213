"""GGUF import: each GGUF block type lands exactly on MatMulNBits / GatherBlockQuantized.

Synthetic GGUF files hold every supported type (gguf-py quantizes the 32-value types; K-quant blocks are random
bytes with sane scales, which are valid blocks); a safetensors checkpoint holds their dequantized values as a
Hugging Face folder would (q in transformers' rotary row order); the ONNX graph is written by hand and reads its
weights from that checkpoint: a tied embedding, two projections reading the same input, one weight with no GGUF
origin. Weights are found by the origins the export would record, never by their values.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import save_file
from tiny_models import whole_file

from trtinfer.artifact import StageDir
from trtinfer.checkpoint import Checkpoint
from trtinfer.gguf_file import GGUFFile, llama_rows
from trtinfer.quantization.gguf import BLOCK_TYPES, decode_tensor, gguf_source, import_gguf, stage_origins
from trtinfer.stage_weights import CheckpointTensor, load_graph

K = 256  # K-quants need whole 256-value super-blocks
V = 64
HEADS = 4  # q's rotary row order: transformers' Llama order for 4 heads of 64
TYPES = list(BLOCK_TYPES)
#: graph initializer -> (checkpoint tensor, read transposed)
REFS = {"E": ("model.embed_tokens.weight", False), "Wq": ("q_proj.weight", True), "Wk": ("k_proj.weight", True),
        "Wx": ("x_proj.weight", True), "Whead": ("model.embed_tokens.weight", True)}


def _blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes ``[n, bytes per row]`` of a random tensor of ``qtype``."""
    gt = GGMLQuantizationType[qtype]
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):  # gguf-py cannot quantize these: random blocks, sane fp16 scales
        elems, size = GGML_QUANT_SIZES[gt]
        raw = rng.integers(0, 256, size=(n * k // elems, size), dtype=np.uint8)
        d = rng.uniform(1e-3, 3e-3, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
        if qtype == "Q6_K":
            raw[:, 208:210] = d
        else:
            raw[:, 0:2] = d
            raw[:, 2:4] = (rng.uniform(1e-3, 3e-3, size=(raw.shape[0], 1)).astype(np.float16)).view(np.uint8)
        return raw.reshape(n, -1)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return np.asarray(quants.quantize(w, gt)).reshape(n, -1)


def _deq(qtype: str, raw: np.ndarray, n: int) -> np.ndarray:
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType[qtype]), np.float32).reshape(n, -1)


def _write_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    w = GGUFWriter(str(path), arch="llama")
    for name, (qtype, raw) in tensors.items():
        if qtype == "F32":
            w.add_tensor(name, raw)
        else:
            w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", TYPES)
def test_decoders_equal_gguf_dequantize(qtype: str) -> None:
    rng = np.random.default_rng(1)
    raw = _blocks(qtype, 8, 512, rng)
    blocks = decode_tensor("t", qtype, raw, 512)
    ref = _deq(qtype, raw, 8)
    got = blocks.rows()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-7 * np.abs(ref).max())
    if blocks.offsets is None:  # no offset: exactly ggml's products
        np.testing.assert_array_equal(got, ref)
    assert blocks.weight.codes.max() < 1 << blocks.weight.bits


def _model(e: np.ndarray, wq: np.ndarray, wk: np.ndarray, wx: np.ndarray, ckpt: Path | None = None,
           unbound: tuple[str, ...] = ()) -> ir.Model:
    """ids -> Gather(E) -> (MatMul Wq + MatMul Wk) -> MatMul Wx -> MatMul E^T (tied LM head).

    With ``ckpt``, the weights (but ``unbound``) are read from that checkpoint, as a stage's graph reads them.
    """
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["emb"], name="/embed/Gather"),
        helper.make_node("MatMul", ["emb", "Wq"], ["q"], name="/q_proj/MatMul"),
        helper.make_node("MatMul", ["emb", "Wk"], ["k"], name="/k_proj/MatMul"),
        helper.make_node("Add", ["q", "k"], ["qk"], name="/add"),
        helper.make_node("MatMul", ["qk", "Wx"], ["x"], name="/x_proj/MatMul"),
        helper.make_node("MatMul", ["x", "Whead"], ["logits"], name="/lm_head/MatMul"),
    ]
    inits = [numpy_helper.from_array(a, n) for n, a in
             [("E", e), ("Wq", wq), ("Wk", wk), ("Wx", wx), ("Whead", np.ascontiguousarray(e.T))]]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", e.shape[0]]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", "s", K])], inits)
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    if ckpt is not None:
        checkpoint = Checkpoint(ckpt)
        for init, (tensor, transpose) in REFS.items():
            if init not in unbound:
                value = model.graph.initializers[init]
                cut = e.shape[0] if tensor == "model.embed_tokens.weight" and e.shape[0] < V else None
                bound = CheckpointTensor(checkpoint, tensor, transpose, init, rows=cut)
                np.testing.assert_array_equal(bound.numpy(), value.const_value.numpy())  # type: ignore[union-attr]
                value.const_value = bound
    return model


def _session(model: ir.Model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), so, providers=["CPUExecutionProvider"])


def _case(tmp_path: Path, emb_t: str, q_t: str, k_t: str) -> tuple[Path, dict[str, np.ndarray], dict[str, dict]]:
    """A GGUF file, the graph's weights (as arrays), and each checkpoint tensor's GGUF origin (the export's record).

    The checkpoint (``tmp_path / "ckpt"``) holds the dequantized tensors in Hugging Face layout, q in the rotary row
    order transformers gives Llama's q.
    """
    rng = np.random.default_rng(hash((emb_t, q_t, k_t)) % 2**32)
    raws = {"token_embd.weight": (emb_t, _blocks(emb_t, V, K, rng)), "blk.0.attn_q.weight": (q_t, _blocks(q_t, K, K, rng)),
            "blk.0.attn_k.weight": (k_t, _blocks(k_t, K, K, rng)),
            "blk.0.attn_norm.weight": ("F32", rng.standard_normal(K).astype(np.float32))}
    path = tmp_path / "m.gguf"
    _write_gguf(path, raws)
    hf = {"model.embed_tokens.weight": _deq(emb_t, raws["token_embd.weight"][1], V),
          "q_proj.weight": _deq(q_t, raws["blk.0.attn_q.weight"][1], K)[llama_rows(K, HEADS)],
          "k_proj.weight": _deq(k_t, raws["blk.0.attn_k.weight"][1], K),
          "x_proj.weight": (rng.standard_normal((K, K)) * 0.05).astype(np.float32)}
    (tmp_path / "ckpt").mkdir(exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in hf.items()}, str(tmp_path / "ckpt" / "model.safetensors"))
    arrays = {"E": hf["model.embed_tokens.weight"], "Wq": np.ascontiguousarray(hf["q_proj.weight"].T),
              "Wk": np.ascontiguousarray(hf["k_proj.weight"].T), "Wx": np.ascontiguousarray(hf["x_proj.weight"].T)}
    origins = {"model.embed_tokens.weight": {"gguf": "token_embd.weight", "type": emb_t, "rows": "identity"},
               "q_proj.weight": {"gguf": "blk.0.attn_q.weight", "type": q_t, "rows": {"heads": HEADS}},
               "k_proj.weight": {"gguf": "blk.0.attn_k.weight", "type": k_t, "rows": "identity"}}
    return path, arrays, origins


COMBOS = [("Q8_0", "Q4_1", "Q4_1"), ("Q6_K", "Q4_K", "Q5_0"), ("Q4_1", "Q5_1", "Q6_K"), ("Q4_0", "Q5_K", "Q8_0"),
          ("Q4_K", "Q4_0", "Q5_1"), ("Q5_0", "Q6_K", "Q4_K")]


@pytest.mark.parametrize("emb_t,q_t,k_t", COMBOS)
def test_import_matches_fp32_graph(tmp_path: Path, emb_t: str, q_t: str, k_t: str) -> None:
    path, a, origins = _case(tmp_path, emb_t, q_t, k_t)
    ref_model = _model(a["E"], a["Wq"], a["Wk"], a["Wx"])
    ref = _session(ref_model)
    outs = {}
    for level in (0, 4):
        model = _model(a["E"], a["Wq"], a["Wk"], a["Wx"], tmp_path / "ckpt")
        report = import_gguf(model, path, origins, accuracy_level=level)
        assert sum(report["counts"].values()) == 4, report  # Gather, q, k, LM head
        assert set(report["kept_float"]) == {"/x_proj/MatMul"}
        assert report["shared_embedding"]
        assert report["bytes_after"] < report["bytes_before"]
        outs[level] = _session(model)
    ops = [n.op_type for n in model.graph]
    assert ops.count("MatMulNBits") == 3 and ops.count("GatherBlockQuantized") == 1
    const_matmuls = [n for n in model.graph if n.op_type == "MatMul" and n.inputs[1] is not None
                     and n.inputs[1].const_value is not None and n.inputs[1].const_value.shape[0] == K]
    assert [n.name for n in const_matmuls] == ["/x_proj/MatMul"]
    # tied: the GatherBlockQuantized reads the LM head's B through a Reshape: one stored copy
    gbq = next(n for n in model.graph if n.op_type == "GatherBlockQuantized")
    head = next(n for n in model.graph if n.op_type == "MatMulNBits" and n.attributes.get_int("N") == V)
    assert gbq.inputs[0].producer().inputs[0] is head.inputs[1]  # type: ignore[union-attr]
    assert "E" not in model.graph.initializers and "Whead" not in model.graph.initializers

    for shape in [(1, 1), (2, 3)]:  # batch 1 decode and a batched prefill
        ids = np.random.default_rng(0).integers(0, V, size=shape).astype(np.int64)
        want_logits, want_emb = ref.run(None, {"ids": ids})
        exact_logits, exact_emb = outs[0].run(None, {"ids": ids})
        fast_logits, _ = outs[4].run(None, {"ids": ids})
        scale = np.abs(want_logits).max()
        assert np.abs(exact_logits - want_logits).max() <= 1e-5 * scale
        assert np.abs(fast_logits - want_logits).max() <= 3e-2 * scale
        if BLOCK_TYPES[emb_t].decode.__name__ in ("_q8_0", "_q4_0", "_q5_0", "_q6_k"):
            np.testing.assert_array_equal(exact_emb, want_emb)  # the same integers times the same scales
        else:
            np.testing.assert_allclose(exact_emb, want_emb, rtol=0, atol=2e-7 * np.abs(want_emb).max())


@pytest.mark.parametrize("emb_t", ["Q4_K", "Q6_K"])
def test_a_cut_vocabulary_imports_its_leading_rows(tmp_path: Path, emb_t: str) -> None:
    """The reduced-depth check's model reads the first rows of the embedding table and LM head: the imported blocks
    are those rows (a Q4_K_M GGUF's reduced check once failed: "data shape and scales shape do not match")."""
    path, a, origins = _case(tmp_path, emb_t, "Q4_K", "Q6_K")
    rows = V // 4
    e = np.ascontiguousarray(a["E"][:rows])
    ref = _session(_model(e, a["Wq"], a["Wk"], a["Wx"]))
    model = _model(e, a["Wq"], a["Wk"], a["Wx"], tmp_path / "ckpt")
    report = import_gguf(model, path, origins, accuracy_level=0)
    assert sum(report["counts"].values()) == 4 and report["shared_embedding"], report
    head = next(n for n in model.graph if n.op_type == "MatMulNBits" and n.name.startswith("/lm_head"))
    assert head.attributes.get_int("N") == rows
    ids = np.array([[0, rows - 1, 3], [5, 1, rows // 2]], np.int64)
    want_logits, want_emb = ref.run(None, {"ids": ids})
    got_logits, got_emb = _session(model).run(None, {"ids": ids})
    assert got_logits.shape == (2, 3, rows)
    assert np.abs(got_logits - want_logits).max() <= 1e-5 * np.abs(want_logits).max()
    np.testing.assert_allclose(got_emb, want_emb, rtol=0, atol=2e-7 * np.abs(want_emb).max())


def test_exclude_and_weights_without_origin(tmp_path: Path) -> None:
    path, a, origins = _case(tmp_path, "Q8_0", "Q4_1", "Q5_0")
    origins["k_proj.weight"]["rows"] = None  # the export found no row order that transformers' processing equals
    model = _model(a["E"], a["Wq"], a["Wk"], a["Wx"], tmp_path / "ckpt", unbound=("Wx",))  # Wx: an initializer
    report = import_gguf(model, path, origins, exclude=lambda name: "q_proj" in name)
    assert report["excluded"] == ["/q_proj/MatMul"]
    assert report["kept_float"] == {
        "/k_proj/MatMul": "k_proj.weight is not a row reordering of GGUF tensor blk.0.attn_k.weight",
        "/x_proj/MatMul": "not read from the checkpoint as stored (computed at export)"}
    assert report["counts"] == {"Q8_0 -> GatherBlockQuantized 8-bit symmetric block 32": 1,
                                "Q8_0 -> MatMulNBits 8-bit symmetric block 32": 1}
    assert "Wq" in model.graph.initializers and "Wk" in model.graph.initializers


def test_float_gguf_tensor_is_reported(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((K, K)).astype(np.float32)
    path = tmp_path / "f.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": ("F32", w)})
    e = rng.standard_normal((V, K)).astype(np.float32)
    (tmp_path / "ckpt").mkdir()
    save_file({"model.embed_tokens.weight": e, "q_proj.weight": w, "k_proj.weight": w, "x_proj.weight": w},
              str(tmp_path / "ckpt" / "model.safetensors"))
    model = _model(e, np.ascontiguousarray(w.T), np.ascontiguousarray(w.T), np.ascontiguousarray(w.T),
                   tmp_path / "ckpt")
    origins = {"q_proj.weight": {"gguf": "blk.0.attn_q.weight", "type": "F32", "rows": "identity"}}
    report = import_gguf(model, path, origins)
    assert report["kept_float"]["/q_proj/MatMul"].startswith("blk.0.attn_q.weight is F32")
    assert not report["imported"]


def test_row_order_is_transformers_llama_order() -> None:
    """llama_rows is the order transformers' own GGUF processing gives Llama's q and k (public ``process``)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    proc = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": 8, "num_key_value_heads": 2})
    for name, n, heads in [("blk.3.attn_q.weight", 512, 8), ("blk.3.attn_k.weight", 128, 2)]:
        idx = np.arange(n, dtype=np.float64)[:, None]
        got = proc.process(weights=idx, name=name).weights[:, 0].astype(np.int64)
        np.testing.assert_array_equal(got, llama_rows(n, heads))
        assert not np.array_equal(got, np.arange(n))


def test_gguf_source(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, {"a.weight": ("F32", np.zeros((4, 32), np.float32))})
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    stage = StageDir(tmp_path, {"source": {"path": "/x", "model": str(path), "sha256": digest, "kind": "gguf"}})
    assert gguf_source(stage) == path
    bad = StageDir(tmp_path, {"source": {"path": "/x", "model": str(path), "sha256": "0" * 64, "kind": "gguf"}})
    assert gguf_source(bad) is None and "sha256" in caplog.text
    folder = StageDir(tmp_path, {"source": {"path": str(tmp_path), "model": str(tmp_path), "kind": "folder"}})
    assert gguf_source(folder) is None
    assert list(GGUFFile(path).tensors) == ["a.weight"]


# --- real models (slow): the packaged GGUF files into their cached optimized fp32 graphs -----------------------

def _cached_optimized(cache: Path, model: str) -> Path | None:
    """An optimized fp32 ONNX Runtime CPU stage of ``model`` in the trtinfer cache at ``cache``, if there is one."""
    for stage_json in sorted((cache / "optimized").glob("*/stage.json")):
        info = json.loads(stage_json.read_text())
        cfg = info.get("history", {}).get("optimize", {}).get("config", {})
        if info.get("source", {}).get("model") == model and cfg.get("precision") == "fp32" \
                and cfg.get("target") == "onnxruntime-cpu" and info.get("kv_layout") == "shared_buffer" \
                and stage_origins(StageDir(stage_json.parent, info)):  # this export format's record
            return stage_json.parent
    return None


def _feeds(sess: ort.InferenceSession, ids: np.ndarray, past: int, max_seq: int) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids
        elif i.name == "seqlens_k":
            feeds[i.name] = np.full(ids.shape[0], past + ids.shape[1] - 1, np.int32)
        elif i.name == "total_sequence_length":
            feeds[i.name] = np.array(past + ids.shape[1], np.int32)
        elif i.name == "logits_positions":  # every new position's logits
            feeds[i.name] = np.tile(np.arange(ids.shape[1], dtype=np.int64), (ids.shape[0], 1))
        else:
            heads, dim = int(i.shape[1]), int(i.shape[3])
            feeds[i.name] = np.random.default_rng(0).standard_normal(
                (ids.shape[0], heads, max_seq, dim)).astype(np.float32) * 0.1
    return feeds


def _time_decode(sess: ort.InferenceSession, feeds: dict[str, np.ndarray], reps: int = 20) -> float:
    sess.run(["logits"], feeds)
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(["logits"], feeds)
        best.append(time.perf_counter() - t0)
    return float(np.median(best)) * 1e3


@pytest.mark.slow
@pytest.mark.parametrize("alias,layers", [("smollm2-135m", 30), ("gemma-3-270m", 18)])
def test_real_gguf_import(tmp_path: Path, alias: str, layers: int, real_engine, in_user_cache) -> None:
    from trtinfer.artifact import ONNX_NAME, read_stage

    real_engine(alias)  # its build leaves the optimized fp32 stage in the user's cache (reused when already there)
    with in_user_cache() as cache:
        src = _cached_optimized(cache, alias)
    assert src is not None, f"building {alias} left no optimized fp32 onnxruntime-cpu stage under {cache}/optimized"
    work = tmp_path / "stage"
    shutil.copytree(src, work)  # never modify the cache
    stage = read_stage(work, verify=False)
    gguf_path = gguf_source(stage)
    assert gguf_path is not None
    model = load_graph(work / ONNX_NAME)  # its weights are read from the checkpoint
    t0 = time.perf_counter()
    report = import_gguf(model, gguf_path, stage_origins(stage))
    seconds = time.perf_counter() - t0
    names = [n for names in report["imported"].values() for n in names]
    assert sum("layers." in n for n in names) == 7 * layers, report["kept_float"]
    assert any("lm_head" in n for n in names) and any("embed_tokens" in n for n in names)
    assert report["shared_embedding"] and not report["kept_float"]
    out = tmp_path / "gguf"
    out.mkdir()
    ir.save(model, out / ONNX_NAME, external_data=ONNX_NAME + ".data")
    fp32_graph = whole_file(work / ONNX_NAME)
    size = {p: sum(f.stat().st_size for f in d.glob(ONNX_NAME + "*"))
            for p, d in (("fp32", fp32_graph.parent), ("gguf", out))}

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    fp32 = ort.InferenceSession(str(fp32_graph), so, providers=["CPUExecutionProvider"])
    q = ort.InferenceSession(str(out / ONNX_NAME), so, providers=["CPUExecutionProvider"])
    ids = np.array([[1, 504, 3458, 314, 260, 1345, 282, 4390, 30, 378, 314, 253, 2412, 282, 260, 1218]], np.int64)
    max_seq = 256
    prefill = _feeds(fp32, ids, 0, max_seq)
    want = fp32.run(["logits"], prefill)[0][0, -1]
    got = q.run(["logits"], prefill)[0][0, -1]  # the last position's
    err = float(np.abs(got - want).max() / np.abs(want).max())
    decode = _feeds(fp32, ids[:, -1:], 128, max_seq)  # one token after a 128-token KV in the shared buffer
    ms = {"fp32": _time_decode(fp32, decode), "gguf": _time_decode(q, decode)}
    print(f"\n{alias}: {report['counts']}\n  import {seconds:.1f} s; logits max err {err:.2e} (rel), top-1 "
          f"{int(got.argmax())} vs {int(want.argmax())}; decode bs1 {ms['fp32']:.2f} ms fp32 -> {ms['gguf']:.2f} ms; "
          f"weights {report['bytes_before'] / 1e6:.0f} -> {report['bytes_after'] / 1e6:.0f} MB; "
          f"on disk {size['fp32'] / 1e6:.0f} -> {size['gguf'] / 1e6:.0f} MB")
    # level 4 quantizes activations to int8 (the import itself is exact: ~3e-6 / 6e-6 at level 0); measured max
    # relative logits error on a fixed-id prompt: SmolLM2 0.025-0.033, Gemma-3 0.063
    assert err < 0.1


@pytest.mark.parametrize("q_t,k_t", [("Q4_1", "Q4_1"), ("Q4_K", "Q4_K"), ("Q4_0", "Q4_0")])
def test_packing_merges_block_sum_corrections(tmp_path: Path, q_t: str, k_t: str) -> None:
    """q and k read one input: one MatMulNBits, and for types with mins one correction MatMul + Add, same logits."""
    from trtinfer.quantization.packing import pack_shared_inputs

    path, a, origins = _case(tmp_path, "Q8_0", q_t, k_t)
    ref = _model(a["E"], a["Wq"], a["Wk"], a["Wx"], tmp_path / "ckpt")
    import_gguf(ref, path, origins, accuracy_level=0, rank_hint=3)
    model = _model(a["E"], a["Wq"], a["Wk"], a["Wx"], tmp_path / "ckpt")
    import_gguf(model, path, origins, accuracy_level=0, rank_hint=3)
    before = [n.op_type for n in model.graph]
    counts = pack_shared_inputs(model.graph)
    after = [n.op_type for n in model.graph]
    assert counts["matmuls_packed"] == 2 and counts["packed_nodes"] == 1
    assert after.count("MatMulNBits") == before.count("MatMulNBits") - 1
    mins = q_t != "Q4_0"
    assert counts["corrections_packed"] == int(mins)
    if mins:  # two correction MatMuls (+ Adds) became one of each
        assert after.count("MatMul") == before.count("MatMul") - 1 and after.count("Add") == before.count("Add") - 1
    assert "Shape" not in after and "Concat" not in after  # block sums reshape by a constant (rank hint)
    ids = np.random.default_rng(1).integers(0, V, size=(2, 3)).astype(np.int64)
    want, _ = _session(ref).run(None, {"ids": ids})
    got, _ = _session(model).run(None, {"ids": ids})
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
