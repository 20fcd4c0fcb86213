"""Torch-free tokenizer: the ``tokenizers`` library plus a jinja2 chat template, as the engine stores them."""
from __future__ import annotations

import datetime
import functools
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trtinfer.errors import EngineLoadError, InputError

log = logging.getLogger(__name__)


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


def check_text(text: str, what: str,
               fix: str = "pass UTF-8 text (decode bytes with errors='replace' to keep the rest)") -> None:
    """Raise InputError naming ``what`` (``"prompt 0"``) and saying ``fix`` when ``text`` is not valid UTF-8.

    Undecodable bytes reach Python as lone surrogates (command-line arguments are decoded with
    ``surrogateescape``); they are reported as the original bytes where that round-trips.
    """
    try:
        text.encode("utf-8")
        return
    except UnicodeEncodeError as e:
        problem = f"lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
    try:
        raw = text.encode("utf-8", "surrogateescape")
        raw.decode("utf-8")
    except UnicodeEncodeError:
        pass
    except UnicodeDecodeError as e:
        problem = f"byte 0x{raw[e.start]:02x} at position {e.start}"
    raise InputError(f"{what} is not valid UTF-8 text ({problem}); {fix}")


class EngineTokenizer:
    """Encode/decode with the engine's ``tokenizer.json``; render its chat template.

    ``encode(text)`` gives the ids ``AutoTokenizer(text)`` gives (special tokens such as BOS included).
    """

    def __init__(self, engine_dir: Path, info: dict[str, Any]) -> None:
        self._tok = read_tokenizer(engine_dir)
        self.engine_dir = Path(engine_dir)
        self.info = info
        self._grammars: dict[int, Any] = {}
        self.eos_token_ids: tuple[int, ...] = tuple(info.get("eos_token_ids") or ())
        self.vocab_size = self._tok.get_vocab_size()
        tpl = self.engine_dir / "chat_template.jinja"
        try:
            self.chat_template: str | None = tpl.read_text(encoding="utf-8") if tpl.is_file() else None
        except (OSError, UnicodeDecodeError) as e:
            raise EngineLoadError(f"{tpl} is not readable UTF-8 text ({e}); rebuild the engine") from e

    def grammars(self, vocab_size: int) -> Any:
        """The structured-output compiler of this tokenizer for ``vocab_size`` logits (made once, on first use)."""
        if vocab_size not in self._grammars:
            from trtinfer.runtime.structured import Grammars

            self._grammars[vocab_size] = Grammars(self.engine_dir, vocab_size, self.eos_token_ids)
        return self._grammars[vocab_size]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; InputError when it is not valid UTF-8."""
        check_text(text, "the text to encode")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    @property
    def backend_tokenizer(self) -> Any:
        """The underlying ``tokenizers.Tokenizer`` (transformers names it so too)."""
        return self._tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token ``token_id`` stands for, special tokens included: where it holds part of a character
        (a byte-level BPE piece, a ``<0xNN>`` byte-fallback token) its raw bytes, which ``decode`` shows as U+FFFD
        (OpenAI's chat logprobs ``bytes``: joined over the tokens of a character, they give its UTF-8)."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self._tok.id_to_token(token_id) or ""
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m[1], 16)])
        from tokenizers.decoders import ByteLevel

        table = _byte_level_table()
        if isinstance(self._tok.decoder, ByteLevel) and piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode("utf-8")  # a real U+FFFD, or a decoder of another kind

    def apply_chat_template(self, messages: list[dict[str, Any]] | str, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, template: str | None = None) -> str:
        """Render ``messages`` (or one user message) through the model's chat template (or ``template``, a
        template's text), as transformers does; ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``)
        reach the template as its ``tools`` variable, and messages may carry ``tool_calls`` / ``tool_call_id``."""
        own = template is None  # the engine's chat_template.jinja: a broken one is the engine's fault, not the input's
        template = template if template is not None else self.chat_template
        if template is None:
            raise InputError("this model has no chat template; drop --chat / chat=True and give plain prompts")
        import jinja2

        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        try:
            compiled, takes_tools = _compiled(template)
        except jinja2.TemplateError as e:
            if own:
                raise EngineLoadError(f"{self.engine_dir / 'chat_template.jinja'} is not a valid jinja template ({e}); "
                                      "fix that file (a rebuild copies the model's own again), or give a template "
                                      "(serve --chat-template)") from e
            raise InputError(f"chat template failed to render: {e}") from e
        if tools and not takes_tools:
            raise InputError("this model's chat template does not render tools; give a template that does (trtinfer "
                             f"serve --chat-template, built in: {', '.join(sorted(BUILTIN_TEMPLATES))})")
        try:
            return compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
                bos_token=self.info.get("bos_token") or "", eos_token=self.info.get("eos_token") or "",
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:  # a message of the wrong shape too
            raise InputError(f"chat template failed to render the messages: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]] | str, tools: list[dict[str, Any]] | None = None,
                    template: str | None = None) -> list[int]:
        """Ids of the rendered chat (the template already holds the special tokens)."""
        return self.encode(self.apply_chat_template(messages, tools=tools, template=template), add_special_tokens=False)


#: a byte-fallback tokenizer's token for one byte (SentencePiece's, e.g. Gemma's)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, which ``tokenizers``' ByteLevel uses): the character standing for each
    byte, inverted. Printable Latin-1 bytes stand for themselves; the rest, in order, for U+0100 onwards."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in own]
    return {**{chr(b): b for b in own}, **{chr(256 + i): b for i, b in enumerate(others)}}


#: chat templates with function calling that ship with trtinfer (``trtinfer/runtime/chat_templates``), by name
BUILTIN_TEMPLATES = {"chatml-tools": "chatml_tools.jinja", "gemma3-tools": "gemma3_tools.jinja"}


def load_chat_template(name_or_path: str) -> str:
    """A chat template's text: a built-in one by name (:data:`BUILTIN_TEMPLATES`) or a jinja file; InputError names
    both kinds when it is neither, or the file does not parse."""
    import jinja2

    if name_or_path in BUILTIN_TEMPLATES:
        text = (Path(__file__).parent / "chat_templates" / BUILTIN_TEMPLATES[name_or_path]).read_text(encoding="utf-8")
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise InputError(f"chat template {name_or_path!r} is neither a built-in one "
                             f"({', '.join(sorted(BUILTIN_TEMPLATES))}) nor a file")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"chat template {path} is not readable UTF-8 text ({e})") from e
    try:
        template_env().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise InputError(f"chat template {name_or_path} does not parse: {e.message} (line {e.lineno})") from e
    return text


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> tuple[Any, bool]:
    """A template's text compiled once (not per chat request) in :func:`template_env`, and whether it reads
    ``tools``."""
    from jinja2 import meta

    env = template_env()
    return env.from_string(template), "tools" in meta.find_undeclared_variables(env.parse(template))


def template_env() -> Any:
    """transformers' template environment: sandboxed, trimmed blocks, loop controls, ``tojson``, ``raise_exception``,
    ``strftime_now``."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise InputError(f"chat template refused the messages: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = raise_exception
    # what transformers' template environment also offers (e.g. Llama 3 templates print today's date)
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class IncrementalDecoder:
    """Token ids -> text deltas at a cost per token that does not grow with the text; stops at stop strings.

    ``tokenizers``' ``DecodeStream`` decodes each new token with the few tokens before it as context and holds back
    the bytes of a character still incomplete (a UTF-8 character split across byte-level tokens). On top of it this
    class holds back any tail of the text that may still grow into one of the ``stop`` strings, and sets
    :attr:`stopped` (and :attr:`stop_string`) once one appears. :meth:`finish` settles the text with one full decode:
    :attr:`text` is ``tokenizer.decode(ids)`` cut before the first stop string in it, and the deltas of :meth:`add`
    and :meth:`finish` joined equal it. One exception: byte-fallback decoders (Llama-2, Gemma) turn a run of byte
    tokens that is not valid UTF-8 into one U+FFFD per byte as a whole, so when invalid bytes come before valid ones
    in the same run, the deltas may hold those valid bytes as text where :attr:`text` has U+FFFD (bytes no
    tokenizer would produce from text; the full decode re-reading every id at every step went wrong there too).
    """

    def __init__(self, tokenizer: EngineTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once one did
        self._stream: Any = _decode_stream()  # None: full decodes (the stream could not follow this decoder)
        self._emitted: list[str] = []  # deltas returned so far
        self._pending = ""  # decoded text not returned yet: a possible stop-string start
        self._final: str | None = None  # the text, once finish() ran

    @property
    def text(self) -> str:
        """The text so far (returned deltas + what is held back); after :meth:`finish`, the final text."""
        return self._final if self._final is not None else "".join(self._emitted) + self._pending

    def add(self, token_id: int) -> str:
        """Append a token; return the newly safe text (may be empty). Sets :attr:`stopped` on a stop string."""
        self.ids.append(int(token_id))
        if self.stopped:
            return ""
        # a stop string can only start inside the held-back text: every earlier possible start was held back
        self._pending = self._cut(self._pending + self._step(int(token_id)))
        return self._release(len(self._pending) - (0 if self.stopped else self._held()))

    def finish(self) -> str:
        """Settle the text with one full decode (and its stop-string cut); return what was not returned yet."""
        full = self._cut(self.tokenizer.decode(self.ids))
        emitted = "".join(self._emitted)
        ok = full.startswith(emitted)
        if not ok:  # an invalid byte run of a byte-fallback decoder (see the class docstring): the full decode wins
            log.debug("streamed text %r is not a prefix of the full decode %r", emitted[-40:], full[-40:])
        self._final, self._pending = full, full[len(emitted):] if ok else ""
        return self._release(len(self._pending))

    def _cut(self, text: str) -> str:
        """``text`` up to the first stop string in it, which sets :attr:`stopped` and :attr:`stop_string`."""
        found = [(at, s) for s in self.stop if (at := text.find(s)) >= 0]
        if not found:
            return text
        at, self.stop_string = min(found)
        self.stopped = True
        return text[:at]

    def _step(self, token_id: int) -> str:
        """The text ``token_id`` adds ("" while a character is incomplete)."""
        if self._stream is not None:
            try:
                return self._stream.step(self.tokenizer.backend_tokenizer, token_id) or ""
            except Exception as e:  # noqa: BLE001  DecodeStream raises a bare Exception when its prefix check fails
                log.debug("DecodeStream gave up (%s); decoding in full from here on", e)
                self._stream = None
        # full decode of every id, as transformers' TextStreamer does; incomplete characters decode to U+FFFD
        full = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        known = "".join(self._emitted) + self._pending
        return full[len(known):] if full.startswith(known) and len(full) > len(known) else ""

    def _held(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string."""
        p = self._pending
        return max((k for s in self.stop for k in range(1, min(len(s), len(p) + 1)) if p.endswith(s[:k])), default=0)

    def _release(self, upto: int) -> str:
        delta, self._pending = self._pending[:upto], self._pending[upto:]
        if delta:
            self._emitted.append(delta)
        return delta


def _decode_stream() -> Any:
    """A fresh ``tokenizers.decoders.DecodeStream`` skipping special tokens (tokenizers >= 0.21, trtinfer's own
    requirement)."""
    from tokenizers.decoders import DecodeStream

    return DecodeStream(skip_special_tokens=True)
