"""trtinfer: export Hugging Face transformers to ONNX, optimize, build engines, and run them fast.

``trtinfer.load(DIR)`` needs only the runtime stack (onnxruntime, numpy, tokenizers).
"""
from __future__ import annotations

__version__ = "0.1.0"

from trtinfer.runtime import Engine, GenerationConfig, GenerationResult, RuntimeConfig, load

__all__ = ["Engine", "GenerationConfig", "GenerationResult", "RuntimeConfig", "__version__", "load"]
