"""Quantized precisions register themselves by name, with the pass targets whose graphs they can rewrite.

A precision is a function ``fn(model: ir.Model, ctx: QuantContext) -> dict`` that rewrites the optimized fp32
graph in place and returns a report (what it quantized, what it kept and why, bytes before and after).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir

from trtinfer.artifact import StageDir
from trtinfer.errors import ConfigError
from trtinfer.quantization.config import QuantConfig

#: the quantize stage's folder of files kept only until its graph is saved (:attr:`QuantContext.scratch`)
SCRATCH_NAME = ".scratch"


@dataclass
class QuantContext:
    """What a precision may read: the input stage, the config, the pass target, the output folder (for
    calibration files) and a place for notes."""

    stage: StageDir
    config: QuantConfig
    target: str
    folder: Path
    progress: bool = True
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def scratch(self) -> Path:
        """A folder in the stage being written for what must wait until the graph is saved (removed after it)."""
        path = self.folder / SCRATCH_NAME
        path.mkdir(exist_ok=True)
        return path

    @property
    def geometry(self) -> dict[str, Any]:
        """The model's geometry (layers, heads, vocab)."""
        return self.stage.geometry


QuantFn = Callable[[ir.Model, QuantContext], dict[str, Any]]


@dataclass(frozen=True)
class PrecisionSpec:
    """A registered quantized precision."""

    name: str
    targets: tuple[str, ...]
    fn: QuantFn
    doc: str


_PRECISIONS: dict[str, PrecisionSpec] = {}


def register_precision(name: str, targets: tuple[str, ...]) -> Callable[[QuantFn], QuantFn]:
    """Decorator: register ``fn`` as the rewrite of precision ``name`` for graphs optimized for ``targets``."""

    def deco(fn: QuantFn) -> QuantFn:
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        _PRECISIONS[f"{name}@{','.join(targets)}"] = PrecisionSpec(name, targets, fn, doc)
        return fn

    return deco


def get_precision(name: str, target: str) -> PrecisionSpec:
    """The rewrite of ``name`` for ``target`` graphs, or an error listing what exists."""
    _load_all()
    for spec in _PRECISIONS.values():
        if spec.name == name and target in spec.targets:
            return spec
    known = sorted({s.name for s in _PRECISIONS.values()})
    if name not in known:
        raise ConfigError(f"unknown quantized precision '{name}'; known: {', '.join(known)}")
    targets = sorted({t for s in _PRECISIONS.values() if s.name == name for t in s.targets})
    raise ConfigError(f"precision {name} is not available for {target} graphs (only {', '.join(targets)}); "
                      f"optimize the export for one of those targets")


def all_precisions() -> list[PrecisionSpec]:
    """Every registered (precision, targets) rewrite."""
    _load_all()
    return list(_PRECISIONS.values())


def _load_all() -> None:
    # importing the modules registers them
    from trtinfer.quantization import gguf_precision, int8_static, weight_only  # noqa: F401
