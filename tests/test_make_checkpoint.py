"""benchmarks/make_checkpoint.py: real-width 2-layer slices of every preset (small vocabulary) written sharded in
bf16 and as one fp32 file, loaded by transformers and run; the tokenizer, the index, determinism, the CLI line."""
from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
TEXT = "The licence grants you the freedom to share and change all versions of a program."


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mc = _load(ROOT / "benchmarks" / "make_checkpoint.py", "make_checkpoint")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return out


# the one-file form in fp32, and in fp16 for the widest preset (fp16 is a source later tests need; half the bytes)
SINGLE = {"llama-3.2-1b": "fp32", "qwen3-8b": "fp32", "qwen3-14b": "fp16"}


@pytest.fixture(scope="module", params=list(mc.PRESETS))
def written(request, tmp_path_factory) -> Iterator[tuple[str, dict[str, Path]]]:
    """One preset's 2-layer slice: bf16 in shards of 100 MB at most, and one file in ``SINGLE[preset]`` (deleted
    afterwards)."""
    preset = request.param
    root = tmp_path_factory.mktemp(preset)
    dirs = {"bf16": root / "bf16", SINGLE[preset]: root / "single"}
    mc.make_checkpoint(dirs["bf16"], mc.CheckpointConfig(preset, layers=2, vocab=VOCAB, seed=7, shard_mb=100))
    mc.make_checkpoint(root / "single", mc.CheckpointConfig(preset, layers=2, vocab=VOCAB, seed=7,
                                                            dtype=SINGLE[preset], single_file=True))
    yield preset, dirs
    shutil.rmtree(root)  # up to 3 GB each: not left for pytest's kept temp folders


def test_transformers_loads_every_weight_and_runs_finite(written):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    preset, dirs = written
    want = mc.PRESETS[preset].config
    logits = {}
    for dtype, folder in dirs.items():
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
        c = model.config
        assert type(model).__name__ == want["architectures"][0] and model.dtype == mc.DTYPES[dtype]
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps"):
            assert getattr(c, key) == want[key], key
        assert (c.num_hidden_layers, c.vocab_size) == (2, VOCAB)
        assert c.rope_parameters == dict(want.get("rope_scaling") or {"rope_type": "default"},
                                         rope_theta=want["rope_theta"])
        ids = AutoTokenizer.from_pretrained(folder)(TEXT, return_tensors="pt").input_ids
        with torch.no_grad():
            logits[dtype] = model(ids).logits.float()
        del model
        assert logits[dtype].isfinite().all()
        assert 0.3 < logits[dtype].std().item() < 5.0  # a trained model's spread, not collapsed or exploding
    # the same model in both dtypes: only the activations' rounding between them
    assert torch.corrcoef(torch.stack([x.flatten() for x in logits.values()]))[0, 1] > 0.99


def test_weights_same_in_every_dtype_and_layout(written):
    preset, dirs = written
    single = SINGLE[preset]
    names = [s.name for s in mc.tensor_specs(mc.model_config(mc.CheckpointConfig(preset, layers=2, vocab=VOCAB)))]
    assert ("lm_head.weight" in names) == (not mc.PRESETS[preset].config["tie_word_embeddings"])
    index = json.loads((dirs["bf16"] / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(dirs[single] / "model.safetensors"), "pt") as one:
        assert sorted(one.keys()) == sorted(index) == sorted(names)
        for name in names:
            with safe_open(str(dirs["bf16"] / index[name]), "pt") as shard:
                a, b = shard.get_slice(name)[:64], one.get_slice(name)[:64]  # 64 rows: reading 3 GB takes long
            assert a.dtype == torch.bfloat16 and b.dtype == mc.DTYPES[single]
            assert torch.equal(a.to(b.dtype), b), name  # drawn in bf16 whatever the file's dtype or shard
            if name.endswith("norm.weight"):
                assert (a.float() - 1).abs().max() < 0.15
            else:
                assert 0.0195 < a.float().std().item() < 0.0205 and a.float().mean().abs() < 0.001


def test_index_covers_every_tensor(written):
    preset, dirs = written
    index = json.loads((dirs["bf16"] / "model.safetensors.index.json").read_text())
    files = sorted(f.name for f in dirs["bf16"].glob("*.safetensors"))
    n = len(files)
    assert n >= 2 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    held, total = {}, 0
    for f in files:
        with safe_open(str(dirs["bf16"] / f), "pt") as st:
            assert st.metadata() == {"format": "pt"}
            names = list(st.keys())
            held.update({k: f for k in names})
            size = sum(math.prod(st.get_slice(k).get_shape()) * 2 for k in names)
        assert size <= 100 * 10**6 or len(names) == 1  # a tensor larger than a shard gets one of its own
        total += size
    assert index["weight_map"] == held and index["metadata"] == {"total_size": total}
    assert sorted(p.name for p in dirs[SINGLE[preset]].glob("model*")) == ["model.safetensors"]


def test_tokenizer_fills_the_vocabulary_and_knows_the_special_ids(written):
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    preset, dirs = written
    p = mc.PRESETS[preset]
    folder = dirs["bf16"]
    config, gen = AutoConfig.from_pretrained(folder), GenerationConfig.from_pretrained(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == config.vocab_size == VOCAB
    assert len(AutoTokenizer.from_pretrained(folder)) == VOCAB
    assert tok.id_to_token(config.bos_token_id) == p.tokens["bos"]
    assert tok.id_to_token(config.eos_token_id) == p.tokens["eos"]
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert [tok.id_to_token(i) for i in eos] == list(p.eos_generation)
    assert tok.id_to_token(VOCAB - 1) == p.specials[-1]  # the named specials end the overridden vocabulary
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert max(ids) < VOCAB - len(p.specials) and tok.decode(ids) == TEXT


@pytest.mark.parametrize("preset", list(mc.PRESETS))
def test_full_size_names_and_shapes_are_transformers_own(preset):
    from transformers import AutoModelForCausalLM

    config = mc.model_config(mc.CheckpointConfig(preset))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del theirs["lm_head.weight"]
    assert {s.name: s.shape for s in mc.tensor_specs(config)} == theirs
    assert config.num_hidden_layers == mc.PRESETS[preset].config["num_hidden_layers"]


@pytest.mark.parametrize(("preset", "ids"), [
    ("llama-3.2-1b", {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>",
                      128255: "<|reserved_special_token_247|>"}),
    ("qwen3-8b", {151643: "<|endoftext|>", 151645: "<|im_end|>", 151668: "</think>"})])
def test_real_vocabulary_has_the_real_special_ids(preset, ids):
    cfg = mc.CheckpointConfig(preset)
    tok = mc.build_tokenizer(cfg)
    assert tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size == mc.PRESETS[preset].config["vocab_size"]
    assert {i: tok.id_to_token(i) for i in ids} == ids
    assert tok.decode(tok.encode(TEXT, add_special_tokens=False).ids) == TEXT


@pytest.fixture
def scratch(tmp_path) -> Iterator[Path]:
    """``tmp_path``, emptied after the test: its checkpoints are not left for pytest's kept temp folders."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_same_seed_same_bytes_and_one_cli_line(scratch, capsys):
    tmp_path = scratch
    args = ["llama-3.2-1b", "--layers", "1", "--vocab", "300"]
    for name in ("a", "b"):
        mc.main([*args, "--shard-mb", "20", "-o", str(tmp_path / name)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("llama-3.2-1b (1 layers, vocab 300, bf16): 61,")
    files = sorted(f.name for f in (tmp_path / "a").iterdir())
    assert files == sorted(f.name for f in (tmp_path / "b").iterdir()) and len(files) > 6
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    mc.main([*args, "-o", str(tmp_path / "c"), "--seed", "1", "--single-file"])
    other = _tensors(tmp_path / "c")
    assert all(not torch.equal(t, other[k]) for k, t in _tensors(tmp_path / "a").items())
    with pytest.raises(SystemExit, match=r"^make_checkpoint: .*exists"):
        mc.main([*args, "-o", str(tmp_path / "a")])  # refused before any work; the folder stays as it was
    with pytest.raises(SystemExit, match="vocab 100 leaves no room"):
        mc.main(["qwen3-8b", "--vocab", "100", "-o", str(tmp_path / "d")])
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_llama_real_width_and_vocabulary_one_layer(scratch):
    tmp_path = scratch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = mc.make_checkpoint(tmp_path / "ck", mc.CheckpointConfig("llama-3.2-1b", layers=1))
    assert s["params"] == 128256 * 2048 + 2 * 2048 + 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192 + 2048
    assert s["files"] == ["model.safetensors"]  # 0.65 GB fits the 5 GB default shard, as on the hub
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ck", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    tok = AutoTokenizer.from_pretrained(tmp_path / "ck")
    assert len(tok) == 128256 and (tok.bos_token_id, tok.eos_token_id) == (128000, 128001)
    with torch.no_grad():
        logits = model(tok(TEXT, return_tensors="pt").input_ids).logits.float()
    assert logits.isfinite().all() and 0.3 < logits.std().item() < 5.0
