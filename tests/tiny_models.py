"""Tiny random-weight models of every supported architecture, with a small trained BPE tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 320
CORPUS = [
    "The history of the city of Paris begins in antiquity, when a Celtic tribe settled on an island.",
    "Machine learning models are exported to ONNX and run with ONNX Runtime on the CPU.",
    "A quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Hello world! Numbers 0123456789 and punctuation: commas, periods; colons.",
] * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(out: Path, add_bos: bool = False) -> None:
    """Train a byte-level BPE of ``VOCAB`` ids and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_config(arch: str):
    """A tiny config of ``arch`` with weights large enough that greedy choices are not near-ties."""
    import transformers as tf

    common = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 256,
              "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 0, "pad_token_id": 0}
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=6)
    if arch == "phi3":
        return tf.Phi3Config(**common, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=5,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=16)
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256,
                             initializer_range=0.1, bos_token_id=1, eos_token_id=0)
    raise KeyError(arch)


ARCHS = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma3", "gpt2")


def make_tiny_model(arch: str, out: Path) -> Path:
    """Save a tiny random ``arch`` model (seed 0) with tokenizer and generation config to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    cfg = make_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=0, pad_token_id=0)
    model.save_pretrained(out)
    save_tokenizer(out, add_bos=arch == "gemma3")
    return out


def whole_file(onnx_path: Path) -> Path:
    """A copy of an export's or optimize stage's graph with every weight written (its weights otherwise stay in the
    checkpoint), for tests that hand the file itself to ONNX Runtime or onnx-ir; made once, beside the stage."""
    from trtinfer.stage_weights import load_graph, save_graph

    out = onnx_path.parent.parent / f"{onnx_path.parent.name}-whole" / onnx_path.name
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        save_graph(load_graph(onnx_path), out, keep_references=False)
        if (onnx_path.parent / "stage.json").is_file():  # the stage's record, for tests that read its facts
            (out.parent / "stage.json").symlink_to((onnx_path.parent / "stage.json").resolve())
    return out


def whole_stage(stage: Any) -> Any:
    """:func:`whole_file` for a stage directory: the same stage record, with its other files linked beside."""
    from trtinfer.artifact import DATA_NAME, ONNX_NAME, StageDir

    path = whole_file(stage.onnx_path)
    for name in stage.info["files"]:
        if name not in (ONNX_NAME, DATA_NAME) and not (path.parent / name).exists():
            (path.parent / name).symlink_to((stage.path / name).resolve())
    return StageDir(path.parent, {**stage.info, "checkpoint_weights": 0})


def stage_engine(session: Any, tokenizer: Any, max_batch_size: int, max_seq_len: int) -> Any:
    """What the runtime's loop needs of an engine (session, tokenizer, manifest limits, defaults) over a stage's
    session: drives an exported or optimized stage (the tensorrt target's graph on ONNX Runtime) like a built engine."""
    from dataclasses import replace
    from types import SimpleNamespace

    from trtinfer.runtime.config import GenerationConfig

    manifest = SimpleNamespace(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                               geometry=session.manifest.geometry, raw=session.manifest.raw)
    return SimpleNamespace(session=session, tokenizer=tokenizer, manifest=manifest,
                           generation_defaults=replace(GenerationConfig()))
