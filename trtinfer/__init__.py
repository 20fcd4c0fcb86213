"""trtinfer: export Hugging Face transformers to ONNX, optimize, build engines, and run them fast.

``trtinfer.load(DIR)`` needs only the runtime stack (onnxruntime, numpy, tokenizers).
"""
from __future__ import annotations

__version__ = "0.1.0"

from trtinfer.runtime import (
    Argmax,
    Distribution,
    Engine,
    Entropy,
    GenerationConfig,
    GenerationResult,
    Logits,
    Logprob,
    Logprobs,
    RuntimeConfig,
    Sampler,
    load,
)

__all__ = ["Argmax", "Distribution", "Engine", "Entropy", "GenerationConfig", "GenerationResult", "Logits", "Logprob",
           "Logprobs", "RuntimeConfig", "Sampler", "__version__", "load"]
