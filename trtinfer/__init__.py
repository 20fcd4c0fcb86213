"""trtinfer: export Hugging Face transformers to ONNX, optimize, build engines, and run them fast.

``trtinfer.load(DIR)`` needs only the runtime stack (onnxruntime, numpy, tokenizers). The names below come from
:mod:`trtinfer.runtime` on first use, so importing another part of the package (``trtinfer.passes``,
``trtinfer.stages``) does not load the runtime.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trtinfer.version import __version__

__all__ = ["Argmax", "Distribution", "Engine", "Entropy", "GenerationConfig", "GenerationResult", "Logits", "Logprob",
           "Logprobs", "RuntimeConfig", "Sampler", "__version__", "load"]

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name in __all__ and name != "__version__":
        from importlib import import_module

        return getattr(import_module("trtinfer.runtime"), name)
    raise AttributeError(f"module 'trtinfer' has no attribute {name!r}")
