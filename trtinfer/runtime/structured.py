"""Structured outputs: a grammar state per sequence masks the logits before each token is chosen.

::

    response_format   {"type": "json_schema", "json_schema": {"schema": {...}}}   OpenAI's
                      {"type": "json_object"}                                     any JSON object
                      {"type": "regex", "regex": "..."}  {"type": "choice", "choice": [...]}
                      {"type": "grammar", "grammar": "..."}                       Lark, or GBNF (has "::=")
         │ normalize_format (checked; a canonical JSON string in GenerationConfig.response_format)
         ▼
    Grammars(engine)  the engine's tokenizer for llguidance, built once (0.5 s SmolLM2, ~4 s Gemma-3's 262k vocab)
         │ .matcher(response_format)  -> a Matcher per sequence
         ▼
    Matcher.mask(logits [V])   tokens the grammar forbids get -inf (a bitmask from llguidance, unpacked in numpy)
    Matcher.consume(token)     the chosen token advances the state; ``done`` once the grammar can go no further

The grammar engine is llguidance (``pip install 'trtinfer[structured]'``): measured against xgrammar on our
tokenizers (``benchmarks/grammar_engines.py``), it needs neither torch nor transformers (the runtime stays light),
compiles a schema in 1-4 ms, never lets special tokens into JSON strings, and passed every walk where xgrammar's
built-in JSON grammar masked a valid token. JSON is compact (no free whitespace between tokens), as OpenAI's
structured outputs are, so a model cannot pad its answer with spaces until it runs out of tokens.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.errors import BackendUnavailableError, GrammarError, InputError
from trtinfer.runtime.tokenizer import check_text

log = logging.getLogger(__name__)

#: response_format types -> the key holding their value (OpenAI's and vLLM's names)
FORMATS = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
_COMPACT = {"whitespace_flexible": False}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy
    except ImportError as e:
        raise BackendUnavailableError("structured outputs (response_format, guided decoding, tools) need llguidance: "
                                      "pip install 'trtinfer[structured]'") from e
    return llguidance


def normalize_format(value: Any) -> str | None:
    """A ``response_format`` (dict or JSON text) checked and made canonical: ``None`` for plain text, else
    ``{"type": T, "value": V}`` as compact JSON text (hashable, comparable; a schema's property order is kept: it is
    the order the fields are written in). InputError says what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InputError(f"response_format must be an object (or its JSON text), got {value[:60]!r}") from e
    if not isinstance(value, Mapping):
        raise InputError(f"response_format must be an object like {{\"type\": \"json_object\"}}, got "
                         f"{type(value).__name__}")
    kind = value.get("type")
    if set(value) == {"type", "value"} and kind in FORMATS[1:]:  # already canonical (a config copied)
        return json.dumps({"type": kind, "value": value["value"]}, separators=(",", ":"))
    if kind not in FORMATS:
        raise InputError(f"response_format.type must be one of {list(FORMATS)}, got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        inner: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise InputError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        inner = dict(spec.get("schema") or {})
    elif kind == "choice":
        inner = value.get("choice")
        if not (isinstance(inner, list) and inner and all(isinstance(c, str) and c for c in inner)):
            raise InputError("response_format choice needs {\"choice\": [\"a\", \"b\", ...]} (non-empty strings)")
    else:
        inner = value.get(kind)
        if not (isinstance(inner, str) and inner.strip()):
            raise InputError(f"response_format {kind} needs {{\"{kind}\": \"...\"}} (a non-empty string)")
    # a lone surrogate (JSON's "\ud800") would reach the grammar compiler, which cannot encode it
    check_text(inner if isinstance(inner, str) else json.dumps(inner, ensure_ascii=False), f"response_format {kind}",
               "write the pattern as valid Unicode text")
    return json.dumps({"type": kind, "value": inner}, separators=(",", ":"))  # schema order kept: it is the output order


@lru_cache(maxsize=256)
def grammar_text(fmt: str) -> str:
    """llguidance's grammar for a canonical format (:func:`normalize_format`); the last 256 are kept."""
    llg = _llguidance()
    spec = json.loads(fmt)
    kind, value = spec["type"], spec["value"]
    if kind in ("json_object", "json_schema"):
        try:
            return str(llg.LLMatcher.grammar_from_json_schema(value, defaults=_COMPACT))
        except (ValueError, TypeError, RuntimeError) as e:
            raise InputError(f"the JSON schema is not usable: {e}") from e
    if kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(value))
    if kind == "choice":
        return str(llg.grammar_from("choice", json.dumps(value)))
    return str(llg.grammar_from("gbnf" if "::=" in value else "lark", value))


class Grammars:
    """One engine's grammar compiler: its tokenizer in llguidance's form (built once, on first use)."""

    def __init__(self, engine_dir: Path, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.engine_dir, self.vocab_size, self.eos_ids = Path(engine_dir), int(vocab_size), tuple(eos_ids)
        self._tok: Any = None
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        """llguidance's ``LLTokenizer`` of the engine's tokenizer.json (the EOS ids given explicitly)."""
        with self._lock:
            if self._tok is None:
                llg = _llguidance()
                text = (self.engine_dir / "tokenizer.json").read_text(encoding="utf-8")
                eos = self.eos_ids[0] if self.eos_ids else None
                self._tok = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
            return self._tok

    def matcher(self, fmt: str) -> Matcher:
        """A fresh grammar state for one sequence; InputError for a grammar llguidance refuses (with its reason)."""
        llg = _llguidance()
        m = llg.LLMatcher(self.tokenizer(), grammar_text(fmt), log_level=0)
        if m.is_error():  # a grammar llguidance cannot build: the matcher says why (compiled once, not twice)
            reason = " ".join(str(m.get_error()).split())  # one line: llguidance's caret excerpt spans several
            raise GrammarError(f"response_format is not a usable grammar: {reason}", reason)
        return Matcher(m, self.vocab_size)


class Matcher:
    """One sequence's grammar state over a vocabulary of ``vocab`` logits."""

    def __init__(self, m: Any, vocab: int) -> None:
        import llguidance.numpy as lln

        self._m, self.vocab, self._lln = m, vocab, lln
        self._bits = lln.allocate_token_bitmask(1, vocab)

    def allowed(self) -> np.ndarray:
        """bool ``[V]``: the tokens the grammar takes next."""
        self._lln.fill_next_token_bitmask(self._m, self._bits, 0)
        return np.unpackbits(self._bits[0].view(np.uint8), count=self.vocab, bitorder="little").view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits [V]`` with the tokens the grammar forbids at -inf (a copy)."""
        out = np.array(logits, dtype=np.float32, copy=True)
        ok = self.allowed()
        if not ok.any():
            raise InputError(f"the grammar allows no next token ({self._m.get_error() or 'dead end'})")
        np.copyto(out, np.float32(-np.inf), where=~ok[:out.shape[-1]])
        return out

    def consume(self, token: int) -> None:
        """Advance past ``token`` (one the mask allowed)."""
        if not self._m.consume_token(int(token)):  # the mask allowed some, so other settings banned all of those
            said = (self._m.get_error() or "").strip().splitlines()
            raise InputError(f"no token the response_format allows is left once the other settings filter them "
                             "(no_repeat_ngram_size, min_new_tokens, bad words, a logits processor): loosen one "
                             f"of them (token {token} chosen; {said[0][:160] if said else 'grammar error'})")

    @property
    def done(self) -> bool:
        """True once the grammar is complete and takes nothing more (the sequence ends here)."""
        return bool(self._m.is_stopped())
