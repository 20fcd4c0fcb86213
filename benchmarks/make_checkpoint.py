"""Seeded random-weight checkpoints in the exact shapes of real models, written the way the hub ships them.

usage: python -m benchmarks.make_checkpoint PRESET -o DIR [--layers N] [--vocab V] [--seed S]
                                            [--dtype bf16|fp16|fp32] [--single-file | --shard-mb MB] [--force]

Presets: llama-3.2-1b, qwen3-8b, qwen3-14b (public config.json values). DIR gets ``config.json`` (transformers'
own keys), ``generation_config.json``, a byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json``)
whose vocabulary is exactly ``vocab_size`` with the model's special tokens at their real ids, and the weights:
``model-0000K-of-0000N.safetensors`` shards of at most ``--shard-mb`` (default 5000, the hub's usual 5 GB) plus
``model.safetensors.index.json``, or one ``model.safetensors`` when everything fits in one shard (as
``save_pretrained`` does) or with ``--single-file``.

Weights: linear and embedding weights N(0, 0.02), RMSNorm weights (Qwen3's q/k norms too) 1 + 0.02 N(0, 1), so
activations stay finite through every layer and logits have a realistic spread. Each tensor is drawn in bfloat16
(the dtype these models are trained and shipped in) from a generator seeded by (seed, tensor name), so its bytes
depend neither on the shard layout nor on the other tensors, and fp16/fp32 checkpoints hold the same model (fp32
exactly, fp16 to within fp16 rounding). Tensors are made by a few threads just ahead of a writer that streams them
into the shard files: peak memory is a few tensors, never a shard or the model. The folder is written beside DIR
and renamed at the end, so DIR is never half-written. ``--layers`` writes an N-layer slice of the same width and
``--vocab`` overrides the vocabulary (the special tokens then move to its top), for tests of the mechanics.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

from trtinfer._outputs import atomic_dir
from trtinfer.errors import ConfigError, TrtInferError

TEXTS = ROOT / "trtinfer" / "calibration" / "texts"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
STD = 0.02
CHUNK = 1 << 24  # elements drawn per generator call; part of the definition of the bytes, so never change it
BPE_TRAINED = 8192  # at most this many tokens are learned from the texts; the rest of the model vocabulary is filler
MB = 10**6

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")
# simplified forms of the real templates (same special tokens and layout, none of the tool-calling logic)
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
               " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class Preset:
    """A real model's shapes: transformers config values, where its special tokens sit, its generation defaults.

    Token ids in the config and generation config are given as token strings and resolved against the tokenizer
    written with the checkpoint, so they stay right when ``--vocab`` moves the special tokens.
    """

    config_class: str  # transformers class name
    config: dict[str, Any]
    specials: tuple[str, ...]  # contiguous from special_start; ids above them up to vocab_size are reserved filler
    special_start: int
    reserved: str  # name pattern of the filler special tokens above the named ones
    reserved_first: int  # number in the first filler's name (Llama 3 numbers on from its named reserved tokens)
    tokens: dict[str, str | None]  # bos, eos (config.json); tokenizer_bos, pad (tokenizer_config.json)
    generation: dict[str, Any]  # generation_config.json's sampling defaults
    eos_generation: tuple[str, ...]  # generation_config.json's eos_token_id (a list when more than one)
    chat_template: str


def _qwen3(hidden: int, layers: int, heads: int, intermediate: int) -> Preset:
    return Preset(
        config_class="Qwen3Config",
        config={"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": intermediate, "vocab_size": 151936,
                "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                "rms_norm_eps": 1e-6, "max_window_layers": layers, "architectures": ["Qwen3ForCausalLM"]},
        specials=QWEN3_SPECIALS, special_start=151643, reserved="<|reserved_{}|>", reserved_first=0,
        tokens={"bos": "<|endoftext|>", "eos": "<|im_end|>", "tokenizer_bos": None, "pad": "<|endoftext|>"},
        generation={"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95},
        eos_generation=("<|im_end|>", "<|endoftext|>"), chat_template=CHATML)


PRESETS: dict[str, Preset] = {
    "llama-3.2-1b": Preset(
        config_class="LlamaConfig",
        config={"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
                "rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                "architectures": ["LlamaForCausalLM"]},
        specials=LLAMA3_SPECIALS, special_start=128000, reserved="<|reserved_special_token_{}|>",
        reserved_first=3,
        tokens={"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "tokenizer_bos": "<|begin_of_text|>",
                "pad": None},
        generation={"do_sample": True, "temperature": 0.6, "top_p": 0.9},
        eos_generation=("<|end_of_text|>",), chat_template=LLAMA3_CHAT),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408),
}


@dataclass(frozen=True)
class CheckpointConfig:
    """What to write: a preset, optionally sliced to ``layers`` and re-vocabularied to ``vocab``, in ``dtype``."""

    preset: str
    layers: int | None = None  # None: the preset's own depth
    vocab: int | None = None  # None: the preset's own vocabulary
    seed: int = 0
    dtype: str = "bf16"
    shard_mb: float = 5000.0
    single_file: bool = False
    workers: int = 2  # threads drawing tensors ahead of the writer

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.layers is not None and self.layers < 1:
            raise ConfigError(f"layers must be >= 1, got {self.layers}")
        least = 256 + len(PRESETS[self.preset].specials)  # the byte alphabet and the named special tokens
        if self.vocab is not None and self.vocab < least:
            raise ConfigError(f"vocab {self.vocab} leaves no room for the 256 byte tokens and "
                             f"{least - 256} special tokens; use --vocab {least} or more")
        if self.shard_mb <= 0 or self.workers < 1:
            raise ConfigError(f"shard_mb must be > 0 and workers >= 1, got {self.shard_mb} and {self.workers}")

    @property
    def vocab_size(self) -> int:
        """The vocabulary written: ``vocab`` or the preset's."""
        return self.vocab or PRESETS[self.preset].config["vocab_size"]

    @property
    def special_start(self) -> int:
        """Id of the first named special token: the real one, or at the top of an overridden vocabulary."""
        p = PRESETS[self.preset]
        return p.special_start if self.vocab is None else self.vocab - len(p.specials)


@dataclass(frozen=True)
class TensorSpec:
    """One weight: its transformers name, shape, and how it is drawn (``mean`` + ``STD`` * N(0, 1))."""

    name: str
    shape: tuple[int, ...]
    mean: float = 0.0

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def model_config(cfg: CheckpointConfig) -> Any:
    """The transformers config of ``cfg``: the preset's values, depth/vocabulary overrides, token ids, and the
    weights' dtype (bfloat16 as the hub ships these models; float32/float16 for the other sources)."""
    import transformers

    p = PRESETS[cfg.preset]
    values = dict(p.config, dtype=str(DTYPES[cfg.dtype]).removeprefix("torch."), vocab_size=cfg.vocab_size,
                  bos_token_id=special_id(cfg, p.tokens["bos"]), eos_token_id=special_id(cfg, p.tokens["eos"]))
    if cfg.layers is not None:
        values["num_hidden_layers"] = cfg.layers
        if "max_window_layers" in values:
            values["max_window_layers"] = cfg.layers
    return getattr(transformers, p.config_class)(**values)


def special_id(cfg: CheckpointConfig, token: str | None) -> int | None:
    """Id of a named special token of the preset in the vocabulary of ``cfg`` (None for None)."""
    if token is None:
        return None
    return cfg.special_start + PRESETS[cfg.preset].specials.index(token)


def tensor_specs(config: Any) -> list[TensorSpec]:
    """Every weight of a Llama/Qwen3 decoder with ``config``'s shapes, in module order, named as transformers does.

    ``lm_head.weight`` only when the embeddings are untied; ``q_norm``/``k_norm`` only for Qwen3.
    """
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    specs = [TensorSpec("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        specs += [TensorSpec(pre + "input_layernorm.weight", (h,), 1.0),
                  TensorSpec(pre + "self_attn.q_proj.weight", (q, h)),
                  TensorSpec(pre + "self_attn.k_proj.weight", (kv, h)),
                  TensorSpec(pre + "self_attn.v_proj.weight", (kv, h)),
                  TensorSpec(pre + "self_attn.o_proj.weight", (h, q))]
        if config.model_type == "qwen3":
            specs += [TensorSpec(pre + "self_attn.q_norm.weight", (hd,), 1.0),
                      TensorSpec(pre + "self_attn.k_norm.weight", (hd,), 1.0)]
        specs += [TensorSpec(pre + "post_attention_layernorm.weight", (h,), 1.0),
                  TensorSpec(pre + "mlp.gate_proj.weight", (inter, h)),
                  TensorSpec(pre + "mlp.up_proj.weight", (inter, h)),
                  TensorSpec(pre + "mlp.down_proj.weight", (h, inter))]
    specs.append(TensorSpec("model.norm.weight", (h,), 1.0))
    if not config.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (config.vocab_size, h)))
    return specs


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name``: a hash of (seed, name), so no tensor depends on another."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def make_tensor(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """``spec`` drawn in bfloat16 (``CHUNK`` elements per draw) from its own generator, stored as ``dtype``."""
    gen = torch.Generator().manual_seed(tensor_seed(seed, spec.name))
    out = torch.empty(spec.shape, dtype=dtype)
    flat = out.view(-1)
    scratch = None if dtype == torch.bfloat16 else torch.empty(min(CHUNK, spec.numel), dtype=torch.bfloat16)
    for a in range(0, spec.numel, CHUNK):
        b = min(a + CHUNK, spec.numel)
        if scratch is None:
            flat[a:b].normal_(spec.mean, STD, generator=gen)
        else:
            flat[a:b].copy_(scratch[:b - a].normal_(spec.mean, STD, generator=gen))
    return out


def plan_shards(specs: list[TensorSpec], dtype: torch.dtype, shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Tensors grouped into shards in order, a new shard when the next tensor would pass ``shard_bytes`` (None: one).

    A tensor larger than a shard gets a shard of its own, as transformers' ``save_pretrained`` does.
    """
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    width = dtype.itemsize
    for s in specs:
        n = s.numel * width
        if shard_bytes is not None and shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += n
    return shards


def write_safetensors(path: Path, specs: list[TensorSpec], tensors: Iterator[torch.Tensor],
                      dtype: torch.dtype) -> None:
    """Stream ``tensors`` (one per spec, in order) into a safetensors file whose header is known up front."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        n = s.numel * dtype.itemsize
        header[s.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(s.shape), "data_offsets": [offset,
                                                                                                     offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors itself writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for s in specs:
            t = next(tensors)
            assert t.shape == s.shape and t.dtype == dtype and t.is_contiguous()
            f.write(t.view(-1).view(torch.uint8).numpy().data)


def _drawn(specs: list[TensorSpec], seed: int, dtype: torch.dtype, workers: int) -> Iterator[torch.Tensor]:
    """``make_tensor`` of each spec in order, ``workers`` of them drawn ahead in threads."""
    with ThreadPoolExecutor(workers) as pool:
        ahead: deque[Future[torch.Tensor]] = deque()
        it = iter(specs)
        for s in it:
            ahead.append(pool.submit(make_tensor, s, seed, dtype))
            if len(ahead) >= workers:
                break
        while ahead:
            t = ahead.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                ahead.append(pool.submit(make_tensor, nxt, seed, dtype))
            yield t
            del t


def build_tokenizer(cfg: CheckpointConfig) -> Any:
    """A byte-level BPE tokenizer of exactly ``cfg.vocab_size`` tokens, with the preset's special tokens at their ids.

    Up to ``BPE_TRAINED`` tokens are learned from trtinfer's calibration texts (deterministic), the rest of the model
    vocabulary below the special tokens is unreachable filler (``<unused_N>``), and ids above the named special tokens
    are reserved special tokens, as Llama 3's are.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    p, start, size = PRESETS[cfg.preset], cfg.special_start, cfg.vocab_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=min(start, BPE_TRAINED), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in sorted(TEXTS.glob("*.txt"))], trainer)
    learned = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = learned["vocab"]
    for i in range(len(vocab), start):
        vocab[f"<unused_{i}>"] = i
    if len(vocab) != start:
        raise RuntimeError(f"tokenizer vocabulary has {len(vocab)} tokens below the specials, expected {start}")
    pairs = [m.split(" ") if isinstance(m, str) else m for m in learned["merges"]]  # older files: "a b"
    merges = [(a, b) for a, b in pairs]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fillers = range(p.reserved_first, p.reserved_first + size - start - len(p.specials))
    named = list(p.specials) + [p.reserved.format(i) for i in fillers]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in named])
    bos = p.tokens["tokenizer_bos"]
    if bos is not None:
        bos_id = special_id(cfg, bos)
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos}:1 $B:1",
                                                           special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size(with_added_tokens=True) != size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, expected {size}")
    return tok


def write_tokenizer(cfg: CheckpointConfig, folder: Path) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` (and the chat template) as transformers saves them."""
    from transformers import PreTrainedTokenizerFast

    p = PRESETS[cfg.preset]
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(cfg), bos_token=p.tokens["tokenizer_bos"],
                                   eos_token=p.tokens["eos"], pad_token=p.tokens["pad"],
                                   model_max_length=p.config["max_position_embeddings"])
    fast.chat_template = p.chat_template
    fast.save_pretrained(folder)
    # transformers 5 names its own backend class; the hub's Llama files name this one, which 4.x and 5.x both load
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), tokenizer_class="PreTrainedTokenizerFast"),
                               indent=2) + "\n")


def write_generation_config(cfg: CheckpointConfig, folder: Path) -> None:
    """``generation_config.json`` with the preset's sampling defaults and token ids."""
    from transformers import GenerationConfig

    p = PRESETS[cfg.preset]
    eos = [special_id(cfg, t) for t in p.eos_generation]
    values = dict(p.generation, bos_token_id=special_id(cfg, p.tokens["bos"]), eos_token_id=eos[0] if len(eos) == 1
                  else eos)
    if p.tokens["pad"] is not None:
        values["pad_token_id"] = special_id(cfg, p.tokens["pad"])
    GenerationConfig(**values).save_pretrained(folder)


def write_weights(cfg: CheckpointConfig, config: Any, folder: Path) -> dict[str, Any]:
    """The weight files (shards + index, or one ``model.safetensors``); returns params, bytes and file names."""
    dtype = DTYPES[cfg.dtype]
    specs = tensor_specs(config)
    shards = plan_shards(specs, dtype, None if cfg.single_file else int(cfg.shard_mb * MB))
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    tensors = _drawn(specs, cfg.seed, dtype, cfg.workers)
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(folder / name, shard, tensors, dtype)
    total = sum(s.numel for s in specs) * dtype.itemsize
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {s.name: name for name, shard in zip(names, shards) for s in shard}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"params": sum(s.numel for s in specs), "bytes": total, "files": names}


def make_checkpoint(out: str | Path, cfg: CheckpointConfig, *, overwrite: bool = False) -> dict[str, Any]:
    """Write the checkpoint of ``cfg`` to ``out`` (in a temp folder beside it, renamed at the end); a summary."""
    t0 = time.perf_counter()
    config = model_config(cfg)
    with atomic_dir(out, overwrite=overwrite, alternative="pick another -o or pass --force") as tmp:
        config.save_pretrained(tmp)
        write_generation_config(cfg, tmp)
        write_tokenizer(cfg, tmp)
        summary = write_weights(cfg, config, tmp)
    return dict(summary, preset=cfg.preset, layers=config.num_hidden_layers, vocab=cfg.vocab_size, dtype=cfg.dtype,
                seconds=round(time.perf_counter() - t0, 2), path=str(out))


def main(argv: list[str] | None = None) -> None:
    """The command line: one summary line on stdout, or one error line and a non-zero exit."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=list(PRESETS))
    ap.add_argument("-o", "--out", required=True, help="the checkpoint folder to create")
    ap.add_argument("--layers", type=int, help="write an N-layer slice of the same width (default: all)")
    ap.add_argument("--vocab", type=int, help="override the vocabulary size (mechanics-only tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    layout = ap.add_mutually_exclusive_group()
    layout.add_argument("--single-file", action="store_true", help="one model.safetensors, no index")
    layout.add_argument("--shard-mb", type=float, default=5000.0, help="largest shard in MB (10^6 bytes)")
    ap.add_argument("--workers", type=int, default=2, help="threads drawing tensors ahead of the writer")
    ap.add_argument("--force", action="store_true", help="replace an existing folder")
    a = ap.parse_args(argv)
    try:
        cfg = CheckpointConfig(a.preset, layers=a.layers, vocab=a.vocab, seed=a.seed, dtype=a.dtype,
                               shard_mb=a.shard_mb, single_file=a.single_file, workers=a.workers)
        s = make_checkpoint(a.out, cfg, overwrite=a.force)
    except TrtInferError as e:
        raise SystemExit(f"make_checkpoint: {e}") from None
    print(f"{s['preset']} ({s['layers']} layers, vocab {s['vocab']}, {s['dtype']}): {s['params']:,} params, "
          f"{s['bytes'] / 1e9:.2f} GB in {len(s['files'])} file(s), {s['seconds']:.1f} s -> {s['path']}")


if __name__ == "__main__":
    main()
