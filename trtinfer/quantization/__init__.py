"""The quantize stage: optimized fp32 graph -> int4 / int8 / int8-static / gguf graph (see :mod:`.stage`).

The names below are imported on first use (PEP 562): ``trtinfer.quantization.config`` (what the CLI's flags read)
must import without onnx-ir, so that the runtime verbs work in an install without the export stack.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trtinfer.quantization.config import PRECISIONS, QuantConfig
    from trtinfer.quantization.stage import quantize_cached, quantize_stage

_WHERE = {"PRECISIONS": "config", "QuantConfig": "config", "quantize_cached": "stage", "quantize_stage": "stage"}

__all__ = ["PRECISIONS", "QuantConfig", "quantize_cached", "quantize_stage"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'trtinfer.quantization' has no attribute '{name}'")
    return getattr(importlib.import_module(f"trtinfer.quantization.{_WHERE[name]}"), name)
