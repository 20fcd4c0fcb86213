"""Runtime and generation configuration (frozen, validated)."""
from __future__ import annotations

from dataclasses import dataclass, field

from trtinfer.errors import ConfigError

PROVIDERS = ("cpu", "cuda")


@dataclass(frozen=True)
class RuntimeConfig:
    """How an engine is run: execution provider and threads.

    ``provider="cuda"`` uses ONNX Runtime's CUDA EP with KV on the device and host I/O through pinned buffers.
    ``intra_op_threads=0`` lets ONNX Runtime choose (one per physical core).
    """

    provider: str = "cpu"
    device_id: int = 0
    intra_op_threads: int = 0

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ConfigError(f"provider must be one of {PROVIDERS}, got {self.provider!r}")
        if self.intra_op_threads < 0:
            raise ConfigError(f"intra_op_threads must be >= 0, got {self.intra_op_threads}")


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings; the same names and meanings as transformers' ``generate``."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    eos_token_ids: tuple[int, ...] | None = None  # None: the engine's generation config
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be within 0..max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"),
            (self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be within (0, 1], got {self.top_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
