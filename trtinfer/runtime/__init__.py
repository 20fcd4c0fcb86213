"""Runtime: load an engine directory and generate. Needs onnxruntime, numpy and tokenizers only (no torch)."""
from trtinfer.runtime.config import GenerationConfig, RuntimeConfig
from trtinfer.runtime.engine import Engine, load
from trtinfer.runtime.generator import GenerationResult, StreamEvent, Timings
from trtinfer.runtime.session import DecoderSession, KVCache, open_session, register_backend

__all__ = ["DecoderSession", "Engine", "GenerationConfig", "GenerationResult", "KVCache", "RuntimeConfig",
           "StreamEvent", "Timings", "load", "open_session", "register_backend"]
