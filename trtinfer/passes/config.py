"""Pass stage configuration."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trtinfer.errors import ConfigError

TARGETS = ("onnxruntime-cpu", "onnxruntime-cuda", "tensorrt")
ORT_TARGETS = ("onnxruntime-cpu", "onnxruntime-cuda")  # the targets that may use com.microsoft ops
CPU_TARGET = ORT_TARGETS[0]  # ONNX Runtime on the CPU (MLAS prepacks fp32 GEMM weights)
PRECISIONS = ("fp32", "fp16", "bf16")
KEEP_FP32_GROUPS = ("norms", "softmax", "residual", "logits", "lm_head")
DEFAULT_KEEP_FP32 = ("norms", "softmax", "residual", "logits")


def check_keep_fp32(groups: tuple[str, ...], option: str) -> None:
    """Raise naming ``option`` if ``groups`` holds a name outside :data:`KEEP_FP32_GROUPS`."""
    unknown = sorted(set(groups) - set(KEEP_FP32_GROUPS))
    if unknown:
        raise ConfigError(f"unknown {option} group(s) {', '.join(unknown)}; known: {', '.join(KEEP_FP32_GROUPS)}")


@dataclass(frozen=True)
class PassConfig:
    """Settings of :func:`trtinfer.passes.optimizer`.

    ``target`` picks the pipeline. ``max_seq_len`` sizes the rotary cos/sin caches of fused attention (positions
    the engine will ever see). ``precision`` fp16/bf16 converts weights and compute after the fusions, keeping the
    ``keep_fp32`` groups (of ``norms``, ``softmax``, ``residual``, ``logits``, ``lm_head``) in fp32;
    ``keep_io_types`` leaves graph inputs and outputs (KV included) in fp32 (``logits`` is fp32 while kept).
    ``disable`` names passes to skip (see ``trtinfer optimize --list``).
    """

    target: str = "onnxruntime-cpu"
    max_seq_len: int = 4096
    precision: str = "fp32"
    keep_io_types: bool = False
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    disable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ConfigError(f"unknown pass target '{self.target}'; known: {', '.join(TARGETS)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got '{self.precision}'")
        check_keep_fp32(self.keep_fp32, "keep_fp32")
        if self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for manifests and reports."""
        d = asdict(self)
        d["disable"] = list(self.disable)
        d["keep_fp32"] = list(self.keep_fp32)
        return d
