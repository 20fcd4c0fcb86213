"""Graph passes: cleanup, target-aware fusions, KV layout and precision, run as named pipelines per target.

``optimize(IN.onnx, OUT.onnx, PassConfig(target=...))`` runs one pipeline and returns a :class:`FusionReport`;
``trtinfer build`` runs the pipeline of its backend/target before packaging the engine.

The names below are imported on first use (PEP 562): ``trtinfer.passes.config`` (what the CLI's flags read) must
import without onnx, onnx-ir and onnxscript, so that the runtime verbs work in an install without the export stack.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trtinfer.passes.config import TARGETS, PassConfig
    from trtinfer.passes.optimize import optimize, optimize_model
    from trtinfer.passes.registry import PIPELINES, PassContext, get_pipeline, register_pass
    from trtinfer.passes.report import FusionReport

_WHERE = {"TARGETS": "config", "PassConfig": "config", "optimize": "optimize", "optimize_model": "optimize",
          "PIPELINES": "registry", "PassContext": "registry", "get_pipeline": "registry",
          "register_pass": "registry", "FusionReport": "report"}

__all__ = ["PIPELINES", "TARGETS", "FusionReport", "PassConfig", "PassContext", "get_pipeline", "optimize",
           "optimize_model", "register_pass"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'trtinfer.passes' has no attribute '{name}'")
    return getattr(importlib.import_module(f"trtinfer.passes.{_WHERE[name]}"), name)


class _Package(types.ModuleType):
    """Keeps ``trtinfer.passes.optimize`` the function once the submodule of that name is imported.

    Importing a submodule sets it as an attribute of its package; with the eager imports this package had, the
    function was bound afterwards and won. Bound lazily, the submodule would win and
    ``from trtinfer.passes import optimize`` would give a module.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "optimize" and isinstance(value, types.ModuleType):
            value = value.optimize
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
