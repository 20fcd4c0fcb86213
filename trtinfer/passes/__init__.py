"""Graph passes: cleanup, target-aware fusions, KV layout and precision, run as named pipelines per target.

``optimize(IN.onnx, OUT.onnx, PassConfig(target=...))`` runs one pipeline and returns a :class:`FusionReport`;
``trtinfer build`` runs the pipeline of its backend/target before packaging the engine.

The names below are imported on first use (PEP 562): ``trtinfer.passes.config`` (what the CLI's flags read) must
import without onnx, onnx-ir and onnxscript, so that the runtime verbs work in an install without the export stack.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trtinfer.passes.config import TARGETS, PassConfig
    from trtinfer.passes.optimizer import optimize, optimize_model
    from trtinfer.passes.registry import PIPELINES, PassContext, get_pipeline, register_pass
    from trtinfer.passes.report import FusionReport

_WHERE = {"TARGETS": "config", "PassConfig": "config", "optimize": "optimizer", "optimize_model": "optimizer",
          "PIPELINES": "registry", "PassContext": "registry", "get_pipeline": "registry",
          "register_pass": "registry", "FusionReport": "report"}

__all__ = ["PIPELINES", "TARGETS", "FusionReport", "PassConfig", "PassContext", "get_pipeline", "optimize",
           "optimize_model", "register_pass"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'trtinfer.passes' has no attribute '{name}'")
    return getattr(importlib.import_module(f"trtinfer.passes.{_WHERE[name]}"), name)
