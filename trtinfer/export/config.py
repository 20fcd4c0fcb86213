"""Export stage configuration."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trtinfer.errors import ConfigError

LOGITS_MODES = ("last", "all")


@dataclass(frozen=True)
class ExportConfig:
    """Settings of ``trtinfer.export.export``.

    ``logits="last"`` emits only the last position's logits (``[B,1,V]``): prefill then skips the vocab projection
    of every prompt token, which is most of TTFT on small models. ``atol`` is the logits tolerance of the
    validation against eager, scaled by ``max(1, max|logits|)``; top-1 tokens must also agree. ``layers`` exports
    only the first N decoder layers, ``vocab`` only the first V rows of the embedding table and LM head (tokens
    ``0..V-1``), read from the same checkpoint tensors: the reduced model a build checks in place of a model too
    large to run whole in fp32.
    """

    opset: int = 17
    logits: str = "last"
    validate: bool = True
    atol: float = 1e-4
    layers: int | None = None
    vocab: int | None = None

    def __post_init__(self) -> None:
        if self.logits not in LOGITS_MODES:
            raise ConfigError(f"logits must be one of {LOGITS_MODES}, got {self.logits!r}")
        if not 14 <= self.opset <= 20:
            raise ConfigError(f"opset must be within 14..20 for the TorchScript exporter, got {self.opset}")
        if not self.atol > 0:
            raise ConfigError(f"atol must be > 0, got {self.atol}")
        if self.layers is not None and self.layers < 1:
            raise ConfigError(f"layers must be >= 1, got {self.layers}")
        if self.vocab is not None and self.vocab < 2:
            raise ConfigError(f"vocab must be >= 2, got {self.vocab}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for manifests and cache keys)."""
        return asdict(self)
