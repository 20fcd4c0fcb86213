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
    validation against eager, scaled by ``max(1, max|logits|)``; top-1 tokens must also agree.
    """

    opset: int = 17
    logits: str = "last"
    validate: bool = True
    atol: float = 1e-4

    def __post_init__(self) -> None:
        if self.logits not in LOGITS_MODES:
            raise ConfigError(f"logits must be one of {LOGITS_MODES}, got {self.logits!r}")
        if not 14 <= self.opset <= 20:
            raise ConfigError(f"opset must be within 14..20 for the TorchScript exporter, got {self.opset}")
        if not self.atol > 0:
            raise ConfigError(f"atol must be > 0, got {self.atol}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for manifests and cache keys)."""
        return asdict(self)
