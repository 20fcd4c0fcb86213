"""Passes register themselves by name; pipelines are plain ordered lists of names per target.

A pass is a function ``fn(model: ir.Model, ctx: PassContext) -> int`` that edits the model in place and returns
how many times it fired. ``expected(ctx)`` says how many times it should fire on this model (from the geometry the
exporter embedded), so the report can flag misses.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from trtinfer.errors import ConfigError
from trtinfer.passes.config import PassConfig

GEOMETRY_KEY = "trtinfer.geometry"  # model metadata the exporter writes; fusions read their expectations from it


@dataclass
class PassContext:
    """What passes may read: the config, the model's geometry (may be empty) and notes left by earlier passes."""

    config: PassConfig
    geometry: dict[str, Any]
    notes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_model(cls, model: ir.Model, config: PassConfig, geometry: dict[str, Any] | None = None) -> PassContext:
        """Context with geometry from ``geometry`` or, failing that, the model's ``trtinfer.geometry`` metadata."""
        if geometry is None:
            raw = model.metadata_props.get(GEOMETRY_KEY)
            geometry = json.loads(raw) if raw else {}
        return cls(config, dict(geometry))


PassFn = Callable[[ir.Model, PassContext], int]
ExpectFn = Callable[[PassContext], "int | None"]


@dataclass(frozen=True)
class PassSpec:
    """A registered pass."""

    name: str
    kind: str
    fn: PassFn
    expected: ExpectFn | None
    doc: str


_PASSES: dict[str, PassSpec] = {}


def register_pass(name: str, kind: str = "fusion", expected: ExpectFn | None = None) -> Callable[[PassFn], PassFn]:
    """Decorator: register ``fn`` as pass ``name`` of ``kind`` (cleanup, fusion, layout, precision)."""

    def deco(fn: PassFn) -> PassFn:
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        _PASSES[name] = PassSpec(name, kind, fn, expected, doc)
        return fn

    return deco


def get_pass(name: str) -> PassSpec:
    """The pass called ``name``, or an error listing the known ones."""
    _load_all()
    if name not in _PASSES:
        raise ConfigError(f"unknown pass '{name}'; known: {', '.join(sorted(_PASSES))}")
    return _PASSES[name]


def all_passes() -> dict[str, PassSpec]:
    """Every registered pass by name."""
    _load_all()
    return dict(_PASSES)


PIPELINES: dict[str, list[str]] = {}


def get_pipeline(target: str) -> list[PassSpec]:
    """The ordered passes of ``target``'s pipeline."""
    _load_all()
    if target not in PIPELINES:
        raise ConfigError(f"no pipeline for target '{target}'; known: {', '.join(sorted(PIPELINES))}")
    return [get_pass(n) for n in PIPELINES[target]]


def _load_all() -> None:
    # importing the pass modules registers them; pipelines.py fills PIPELINES
    from trtinfer.passes import pipelines  # noqa: F401
