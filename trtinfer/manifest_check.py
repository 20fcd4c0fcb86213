"""The structure check of an engine's ``manifest.json``: every field the runtime reads, with its type, checked on
write and on read (:func:`trtinfer.artifact.new_manifest`, :func:`trtinfer.artifact.read_manifest`), each failure one
line naming the manifest, the key path and what was found. Stdlib only: the runtime imports it."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trtinfer.errors import EngineLoadError

# what the runtime reads, per engine kind: geometry ints and file roles
GEOMETRY_INTS = {"decoder": ("num_layers", "num_kv_heads", "head_dim", "vocab_size"),
                 "encoder": ("num_layers", "vocab_size")}
FILE_ROLES = {"decoder": ("decoder",), "encoder": ("encoder",)}


def json_int(value: Any) -> bool:
    """An integer JSON can write, not a bool (JSON's ``true`` is not a count): a manifest made in memory
    (:func:`trtinfer.artifact.new_manifest`) with a numpy int in it is refused here, in the manifest's words, not later
    by ``json.dump`` (configs take numpy ints: :func:`trtinfer.runtime.config.is_int`)."""
    return isinstance(value, int) and not isinstance(value, bool)


def show(value: Any) -> str:
    """``value`` as an error message quotes it: short, with its JSON type for objects and lists."""
    text = json.dumps(value) if isinstance(value, (dict, list)) else repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(value).__name__} ({text})" if isinstance(value, (dict, list)) else text


# (description, test) pairs: the description completes "KEY should be ..."
_Rule = tuple[str, Callable[[Any], bool]]
_POSITIVE_INT: _Rule = ("a positive integer", lambda v: json_int(v) and v > 0)
_TOKEN_ID: _Rule = ("a token id (integer >= 0) or null", lambda v: v is None or (json_int(v) and v >= 0))
_TOKEN_IDS: _Rule = ("a list of token ids (integers >= 0) or null",
                     lambda v: v is None or (isinstance(v, list) and all(json_int(t) and t >= 0 for t in v)))
_NAME: _Rule = ("a non-empty string", lambda v: isinstance(v, str) and bool(v))
_TEXT_OR_NULL: _Rule = ("a string or null", lambda v: v is None or isinstance(v, str))
_OBJECT: _Rule = ("a JSON object", lambda v: isinstance(v, dict))
_LIST: _Rule = ("a JSON list", lambda v: isinstance(v, list))
_SHAPE: _Rule = ("a list of dimensions (integers or names)",
                 lambda v: isinstance(v, list) and all(json_int(d) or isinstance(d, str) for d in v))


def _one_of(choices: tuple[str, ...]) -> _Rule:
    return (f"one of {list(choices)}", lambda v: v in choices)


def check_manifest(path: Path, raw: dict[str, Any], kinds: tuple[str, ...], kv_layouts: tuple[str, ...]) -> None:
    """Raise :class:`EngineLoadError` at the first field of the manifest ``raw`` (read from ``path``) that the runtime
    could not use; ``kinds`` and ``kv_layouts`` are the values the artifact module knows."""
    _ManifestCheck(path, kinds, kv_layouts).check(raw)


class _ManifestCheck:
    """Checks the fields the runtime reads; each failure names the manifest, the key path and what was found."""

    def __init__(self, path: Path, kinds: tuple[str, ...], kv_layouts: tuple[str, ...]) -> None:
        self.path, self.kinds, self.kv_layouts = path, kinds, kv_layouts

    def get(self, section: dict[str, Any], key: str, where: str, rule: _Rule, required: bool = True) -> Any:
        """``section[key]`` checked against ``rule``; None when absent and not ``required``."""
        name = f"{where}.{key}" if where else key
        if key not in section:
            if required:
                raise EngineLoadError(f"{self.path} lacks '{name}' ({rule[0]}); rebuild the engine")
            return None
        value = section[key]
        if not rule[1](value):
            raise EngineLoadError(f"{self.path}: {name} should be {rule[0]}, found {show(value)}; "
                                  "rebuild the engine")
        return value

    def check(self, raw: dict[str, Any]) -> None:
        """Raise :class:`EngineLoadError` at the first field of ``raw`` the runtime could not use."""
        kind = self.get(raw, "kind", "", _one_of(self.kinds), required=False) or "decoder"
        self.get(raw, "backend", "", _NAME)
        self.get(raw, "kv_layout", "", _one_of(self.kv_layouts), required=False)
        limits = self.get(raw, "limits", "", _OBJECT)
        for key in ("max_batch_size", "max_seq_len"):
            self.get(limits, key, "limits", _POSITIVE_INT)
        geometry = self.get(raw, "geometry", "", _OBJECT)
        for key in GEOMETRY_INTS[kind]:
            self.get(geometry, key, "geometry", _POSITIVE_INT)
        files = self.get(raw, "files", "", _OBJECT)
        for role in files:
            self.get(files, role, "files", _NAME)
        for role in FILE_ROLES[kind]:
            self.get(files, role, "files", _NAME)
        io = self.get(raw, "io", "", _OBJECT)
        for side in ("inputs", "outputs"):
            for i, spec in enumerate(self.get(io, side, "io", _LIST)):
                where = f"io.{side}[{i}]"
                if not isinstance(spec, dict):
                    raise EngineLoadError(f"{self.path}: {where} should be a JSON object with name, dtype and "
                                          f"shape, found {show(spec)}; rebuild the engine")
                self.get(spec, "name", where, _NAME)
                self.get(spec, "dtype", where, _NAME)
                self.get(spec, "shape", where, _SHAPE)
        tokenizer = self.get(raw, "tokenizer", "", _OBJECT, required=False) or {}
        self.get(tokenizer, "eos_token_ids", "tokenizer", _TOKEN_IDS, required=False)
        self.get(tokenizer, "pad_token_id", "tokenizer", _TOKEN_ID, required=False)
        for key in ("bos_token", "eos_token"):
            self.get(tokenizer, key, "tokenizer", _TEXT_OR_NULL, required=False)
        if kind == "encoder":
            self.get(raw, "pooling", "", _OBJECT, required=False)
