"""A GGUF becomes a Hugging Face folder tensor by tensor: the same values transformers' own loader gives, and each
tensor's GGUF origin (name, ggml type, row order) recorded for GGUF-exact quantization."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants

from trtinfer.errors import ModelSourceError
from trtinfer.gguf_file import GGUFFile, row_order


def _write(path: Path) -> np.ndarray:
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_tensor("blk.0.attn_q.weight", np.asarray(quants.quantize(w, GGMLQuantizationType.Q8_0)),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", w[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w


def test_reader_reads_tensors_by_name(tmp_path: Path) -> None:
    w = _write(tmp_path / "m.gguf")
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.metadata["general.architecture"] == "llama"
    q = f.tensors["blk.0.attn_q.weight"]
    assert (q.qtype, q.shape) == ("Q8_0", (64, 256))
    np.testing.assert_allclose(f.dequantize(q.name), w, atol=np.abs(w).max() / 100)
    np.testing.assert_array_equal(f.dequantize(q.name, slice(8, 16)), f.dequantize(q.name)[8:16])
    np.testing.assert_array_equal(f.dequantize("blk.0.attn_norm.weight"), w[0])


def test_truncated_gguf_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelSourceError, match="blk.0.attn_norm.weight .* truncated; download it again"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + bytes(20))
    with pytest.raises(ModelSourceError, match="version 0"):
        GGUFFile(path)


@pytest.mark.parametrize(("at", "value", "fmt"), [
    (24, 2**62, "<Q"),  # the first key's length: MemoryError, reading it
    (8, 2**40, "<Q"),  # the tensor count: OverflowError
    (16, 2**40, "<Q"),  # the key count
])
def test_a_damaged_length_or_count_is_one_clear_error(tmp_path: Path, at: int, value: int, fmt: str) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelSourceError, match="header of .* is damaged: .* past the end of the file"):
        GGUFFile(path)


def test_a_type_gguf_cannot_dequantize_is_refused_before_any_work(tmp_path: Path) -> None:
    """A tensor type gguf-py has no dequantizer for (Q1_0 in gguf 0.19) failed midway through the conversion with
    NotImplementedError; now one line naming the tensor, before any work."""
    from gguf import GGML_QUANT_SIZES

    _write(tmp_path / "ok.gguf")
    GGUFFile(tmp_path / "ok.gguf").check_dequantizable()  # Q8_0 and F32
    missing = GGMLQuantizationType.Q1_0
    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[missing][1]), np.uint8), missing)
        pytest.skip("this gguf dequantizes Q1_0")
    except NotImplementedError:
        pass
    elems, block = GGML_QUANT_SIZES[missing]
    writer = GGUFWriter(str(tmp_path / "m.gguf"), arch="llama")
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 256 // elems * block), np.uint8), raw_dtype=missing)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.tensors["blk.0.attn_q.weight"].shape == (64, 256)
    with pytest.raises(ModelSourceError, match="blk.0.attn_q.weight of .* is ggml Q1_0, which gguf .* cannot "
                                               "dequantize; upgrade it"):
        f.check_dequantizable()


@pytest.mark.slow
def test_conversion_equals_transformers_loader(tmp_path: Path) -> None:
    """SmolLM2's Q4_1 GGUF: every tensor bit-equal to transformers' from_pretrained(gguf_file=...) in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtinfer.checkpoint import GGUF_LINK, Checkpoint
    from trtinfer.export.gguf_convert import convert_gguf, gguf_origins
    from trtinfer.export.sources import ALIASES

    gguf = ALIASES["smollm2-135m"]()
    out = tmp_path / "hf"
    out.mkdir()
    convert_gguf(gguf, out)  # 0.5 GB of fp32: under COPY_LIMIT, copied
    assert not (out / GGUF_LINK).exists()
    ours = Checkpoint(out)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied: stored once
    assert set(ours.tensors) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(np.asarray(ours.raw(name)), value.numpy(), err_msg=name)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    origins = gguf_origins(out)
    assert set(origins) == set(state)
    file = GGUFFile(gguf)
    for name, o in origins.items():
        assert file.tensors[o["gguf"]].qtype == o["type"]
    q, k = origins["model.layers.0.self_attn.q_proj.weight"], origins["model.layers.0.self_attn.k_proj.weight"]
    assert (q["gguf"], q["rows"], k["rows"]) == ("blk.0.attn_q.weight", {"heads": 9}, {"heads": 3})
    assert origins["model.layers.0.mlp.down_proj.weight"]["rows"] == "identity"
    assert origins["model.norm.weight"]["rows"] is None  # 1-D: no blocks to import
    assert not any(o.get("view") for o in origins.values())
    # the recorded order reproduces the values from the GGUF's own rows
    order = row_order(q["rows"], 576)
    assert order is not None
    np.testing.assert_array_equal(file.dequantize("blk.0.attn_q.weight")[order],
                                  state["model.layers.0.self_attn.q_proj.weight"].numpy())


@pytest.mark.slow
def test_a_large_gguf_is_read_through_views(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF past COPY_LIMIT (here: any) is not copied into the cache as fp32: the export (eager validation, its
    whole-graph copy, the engine check's reference) reads its weights from the GGUF, with the same reference logits
    as from an fp32 copy, and GGUF-exact quantization finds the GGUF through the folder's link when the file the
    user gave is gone."""
    import shutil

    from trtinfer.checkpoint import GGUF_LINK, SINGLE_NAME, Checkpoint
    from trtinfer.export import ExportConfig, export, gguf_convert
    from trtinfer.export.sources import ALIASES, resolve_model
    from trtinfer.quantization.gguf import gguf_source

    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TRTINFER_EXPORT_IN_PROCESS", "1")  # the conversion runs here, with the limit below
    monkeypatch.setattr(gguf_convert, "COPY_LIMIT", 0)
    gguf = tmp_path / "smollm2.gguf"
    shutil.copyfile(ALIASES["smollm2-135m"](), gguf)
    resolved = resolve_model(str(gguf))
    assert (resolved.path / GGUF_LINK).samefile(gguf)
    copied = tmp_path / "copied"
    copied.mkdir()
    gguf_convert.convert_gguf(gguf, copied, views=False)
    views, copies = Checkpoint(resolved.path), Checkpoint(copied)
    origins = gguf_convert.gguf_origins(resolved.path)
    assert {k for k, o in origins.items() if o.get("view")} == {k for k, o in origins.items() if o["rows"]}
    assert (resolved.path / SINGLE_NAME).stat().st_size < 1 << 20  # the norm gains; the copy's: 0.5 GB
    assert set(views.tensors) == set(copies.tensors)
    for name in views.tensors:  # bit-equal to the copy (itself to transformers' loader, above)
        np.testing.assert_array_equal(views.raw(name), copies.raw(name), err_msg=name)
    config = ExportConfig(layers=2)
    viewed, whole = export(resolved, tmp_path / "viewed", config), export(copied, tmp_path / "whole", config)
    assert viewed.validation["passed"] and whole.validation["passed"]
    with np.load(viewed.path / "reference.npz") as a, np.load(whole.path / "reference.npz") as b:
        assert set(a.files) == set(b.files)
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert {w["gguf"]["gguf"] for w in viewed.info["weights"].values() if "gguf" in w} >= {
        "blk.0.attn_q.weight", "token_embd.weight"}
    gguf.unlink()  # the folder's hard link keeps the GGUF's bytes
    assert gguf_source(viewed) == resolved.path / GGUF_LINK
    # the eager baseline of `trtinfer bench` loads such a folder through the views: the copy's tokens and timings
    from trtinfer.bench import run_eager
    from trtinfer.builder import build

    got, ref = (run_eager(build(stage.path, tmp_path / f"engine-{stage.path.name}", progress=False), 1, 16, 6,
                          repeats=1) for stage in (viewed, whole))
    assert got.first_tokens == ref.first_tokens and len(got.first_tokens) == 6
    assert got.ttft_ms > 0 and got.decode_tok_s > 0


def test_a_private_gguf_is_linked_symbolically_and_keeps_its_mode(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF the cache would have to chmod (here 0600: readable by its owner only) is not hard-linked into the
    cached model folder: the folder's modes are set through its names, and would have made the user's file
    world-readable. A symbolic link reads the same bytes."""
    import os
    import shutil
    import stat

    from trtinfer.checkpoint import GGUF_LINK
    from trtinfer.export import gguf_convert
    from trtinfer.export.sources import ALIASES, resolve_model

    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TRTINFER_EXPORT_IN_PROCESS", "1")
    monkeypatch.setattr(gguf_convert, "COPY_LIMIT", 0)  # read through views: the folder links to the GGUF
    gguf = tmp_path / "smollm2.gguf"
    shutil.copyfile(ALIASES["smollm2-135m"](), gguf)
    os.chmod(gguf, 0o600)
    link = resolve_model(str(gguf)).path / GGUF_LINK
    assert link.is_symlink() and link.samefile(gguf)
    assert stat.S_IMODE(gguf.stat().st_mode) == 0o600 and gguf.stat().st_nlink == 1


def test_gguf_py_sped_up_reads_the_same_fields_and_restores_gguf(tmp_path: Path) -> None:
    """Inside the conversion's block gguf-py's reader slices a plain ndarray, not its memmap (13 s -> 5 s on Gemma-3's
    vocabulary): every field and tensor it gives equals the stock reader's, transformers' own GGUF parse gives the same
    result through it, and ``gguf`` is the same module after the block."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from trtinfer.export.gguf_convert import _gguf_py_sped_up

    path = tmp_path / "m.gguf"
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_context_length(128)
    writer.add_token_list([f"tok{i}" for i in range(300)])
    writer.add_token_scores([float(-i) for i in range(300)])
    writer.add_tensor("blk.0.attn_q.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stock_reader, stock_map = gguf.GGUFReader, gguf.get_tensor_name_map
    stock = stock_reader(path)
    stock_parse = load_gguf_checkpoint(str(path), return_tensors=False)
    made: list[Any] = []
    with _gguf_py_sped_up():
        fast = gguf.GGUFReader(path)
        sped_up = gguf.GGUFReader

        class Seen(sped_up):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                made.append(self)

        gguf.GGUFReader = Seen  # what transformers' parse builds (restored by the block)
        fast_parse = load_gguf_checkpoint(str(path), return_tensors=False)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert [type(r.data) for r in made] == [np.ndarray]  # transformers read the file through the sped-up reader
    assert type(fast.data) is np.ndarray and isinstance(stock.data, np.memmap)
    assert list(fast.fields) == list(stock.fields)
    for a, b in zip(fast.fields.values(), stock.fields.values(), strict=True):
        assert (a.offset, a.types, a.data) == (b.offset, b.types, b.data)
        assert all(np.array_equal(x, y) for x, y in zip(a.parts, b.parts, strict=True))
    assert [(t.name, t.data_offset) for t in fast.tensors] == [(t.name, t.data_offset) for t in stock.tensors]
    np.testing.assert_array_equal(fast.tensors[0].data, w)
    assert fast_parse == stock_parse and stock_parse["tokenizer"]["tokens"][299] == "tok299"
    assert gguf.GGUFReader is stock_reader and gguf.get_tensor_name_map is stock_map
