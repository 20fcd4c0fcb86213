"""The named pipelines, top to bottom. Importing the pass modules registers their passes."""
from __future__ import annotations

import importlib

from trtinfer.passes.registry import PIPELINES

PASS_MODULES = ("cleanup", "attention", "layout", "kv_scatter", "norms", "activations", "trt_support", "trt_attention",
                "precision", "embedding")
for _m in PASS_MODULES:
    importlib.import_module(f"trtinfer.passes.{_m}")

# logits_positions before kv_share_buffer: the latter then finds no last-token Slice left to replace
_ORT = ["cleanup", "attention", "rotary", "logits_positions", "kv_share_buffer", "rms_norm", "layer_norm",
        "skip_norm", "gelu", "matmul_bias", "precision", "dead_code"]
PIPELINES["onnxruntime-cpu"] = list(_ORT)
PIPELINES["onnxruntime-cuda"] = list(_ORT)
# kv_scatter raises the opset to 24 before the norms and GELU: TensorRT then gets RMSNormalization and Gelu too
PIPELINES["tensorrt"] = ["cleanup", "tensorrt_attention", "logits_positions", "kv_scatter", "rms_norm", "layer_norm",
                         "gelu", "precision", "dead_code", "tensorrt_check"]
