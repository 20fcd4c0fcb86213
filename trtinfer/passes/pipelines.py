"""The named pipelines, top to bottom. Importing the pass modules registers their passes."""
from __future__ import annotations

import importlib

from trtinfer.passes.registry import PIPELINES

PASS_MODULES = ("cleanup", "attention", "layout")
for _m in PASS_MODULES:
    importlib.import_module(f"trtinfer.passes.{_m}")

PIPELINES["onnxruntime-cpu"] = ["cleanup", "attention", "rotary", "kv_share_buffer", "dead_code"]
PIPELINES["onnxruntime-cuda"] = ["cleanup", "attention", "rotary", "kv_share_buffer", "dead_code"]
PIPELINES["tensorrt"] = ["cleanup", "dead_code"]
