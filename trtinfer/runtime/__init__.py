"""Runtime: load an engine directory and generate. Needs onnxruntime, numpy and tokenizers only (no torch)."""
from trtinfer.runtime.config import GenerationConfig, RuntimeConfig
from trtinfer.runtime.engine import Engine, load
from trtinfer.runtime.forward import Context, Forward, Handle, Output
from trtinfer.runtime.generator import GenerationResult, StreamEvent, Timings
from trtinfer.runtime.probes import Argmax, Distribution, Entropy, Logits, Logprob, Logprobs, Sampler
from trtinfer.runtime.session import DecoderSession, open_session, register_backend
from trtinfer.runtime.slots import SlotCache

__all__ = ["Argmax", "Context", "DecoderSession", "Distribution", "Engine", "Entropy", "Forward", "GenerationConfig",
           "GenerationResult", "Handle", "Logits", "Logprob", "Logprobs", "Output", "RuntimeConfig",
           "Sampler", "SlotCache", "StreamEvent", "Timings", "load", "open_session", "register_backend"]
