"""Torch-free tokenizer: the ``tokenizers`` library plus a jinja2 chat template, as the engine stores them."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trtinfer.errors import EngineLoadError, InputError


def read_tokenizer(engine_dir: Path) -> Any:
    """The engine's ``tokenizer.json`` as a ``tokenizers.Tokenizer``; EngineLoadError when missing or unreadable."""
    from tokenizers import Tokenizer

    path = Path(engine_dir) / "tokenizer.json"
    if not path.is_file():
        raise EngineLoadError(f"{engine_dir} has no tokenizer.json; rebuild the engine")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for truncated or malformed files
        raise EngineLoadError(f"{path} is not a readable tokenizer ({e}); rebuild the engine") from e


def utf8_problem(text: str) -> str | None:
    """Where ``text`` stops being valid UTF-8 (``"byte 0xff at position 0"``), or None when it is valid.

    Undecodable bytes reach Python as lone surrogates (command-line arguments are decoded with
    ``surrogateescape``); they are reported as the original bytes where that round-trips.
    """
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        first = e.start
    try:
        raw = text.encode("utf-8", "surrogateescape")
        raw.decode("utf-8")
    except UnicodeEncodeError:
        pass
    except UnicodeDecodeError as e:
        return f"byte 0x{raw[e.start]:02x} at position {e.start}"
    return f"lone surrogate U+{ord(text[first]):04X} at character {first}"


def check_text(text: str, what: str,
               fix: str = "pass UTF-8 text (decode bytes with errors='replace' to keep the rest)") -> None:
    """Raise InputError naming ``what`` (``"prompt 0"``) and saying ``fix`` when ``text`` is not valid UTF-8."""
    problem = utf8_problem(text)
    if problem is not None:
        raise InputError(f"{what} is not valid UTF-8 text ({problem}); {fix}")


class EngineTokenizer:
    """Encode/decode with the engine's ``tokenizer.json``; render its chat template.

    ``encode(text)`` gives the ids ``AutoTokenizer(text)`` gives (special tokens such as BOS included).
    """

    def __init__(self, engine_dir: Path, info: dict[str, Any]) -> None:
        self._tok = read_tokenizer(engine_dir)
        self.info = info
        self.eos_token_ids: tuple[int, ...] = tuple(info.get("eos_token_ids") or ())
        pad = info.get("pad_token_id")
        self.pad_token_id: int = int(pad) if pad is not None else 0
        self.vocab_size = self._tok.get_vocab_size()
        tpl = engine_dir / "chat_template.jinja"
        self.chat_template: str | None = None
        if tpl.is_file():
            try:
                self.chat_template = tpl.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise EngineLoadError(f"{tpl} is not readable UTF-8 text ({e}); rebuild the engine") from e

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; InputError when it is not valid UTF-8."""
        check_text(text, "the text to encode")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]] | str, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (or one user message) through the model's chat template, as transformers does."""
        if self.chat_template is None:
            raise InputError("this model has no chat template; drop --chat / chat=True and give plain prompts")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]

        def raise_exception(msg: str) -> None:
            raise InputError(f"chat template refused the messages: {msg}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.info.get("bos_token") or "", eos_token=self.info.get("eos_token") or "",
            )
        except jinja2.TemplateError as e:
            raise InputError(f"chat template failed to render: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]] | str) -> list[int]:
        """Ids of the rendered chat (the template already holds the special tokens)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class IncrementalDecoder:
    """Turn a growing list of token ids into text deltas, holding back incomplete UTF-8 and stop-string prefixes."""

    def __init__(self, tokenizer: EngineTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Append a token; return the newly safe text (may be empty). Sets ``stopped`` on a stop string."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids)
        if self.stop:
            cut = min((i for i in (self.text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
                return self.flush()
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe = self.text.rstrip("\ufffd").__len__()
        for s in self.stop:  # keep back a tail that may still become a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if self.text[safe - k:safe] == s[:k]:
                    safe -= k
                    break
        safe = max(safe, self.emitted)
        delta, self.emitted = self.text[self.emitted:safe], safe
        return delta

    def flush(self) -> str:
        """Everything not yet emitted."""
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
