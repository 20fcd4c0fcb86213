"""Quantization stage configuration."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trtinfer.errors import ConfigError

PRECISIONS = ("int4", "int8", "int8-static", "gguf")
METHODS = ("rtn", "gptq")
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class QuantConfig:
    """Settings of :func:`trtinfer.quantization.quantize_stage`.

    ``precision``: ``int4`` (4-bit weight-only blocks, int8 compute), ``int8`` (8-bit weight-only blocks, int8
    compute), ``int8-static`` (explicit QDQ: per-channel int8 weights, per-tensor int8 activations from calibration;
    the form TensorRT compiles), ``gguf`` (the GGUF source's own blocks, imported exactly).
    ``method`` (int4): ``rtn`` rounds each block to nearest; ``gptq`` corrects rounding errors with second-order
    statistics of calibration activations. ``block_size`` (int4/int8, power of 2 >= 16; None: 32 on ONNX Runtime, 128 for TensorRT's int4), ``symmetric`` (zero point
    in the middle of the grid: the fast and, on AVX2, the correct int8 kernel path). ``lm_head_bits`` (4 or 8): the
    LM head and, with tied embeddings, the embedding table sharing it (4 by default: with GPTQ it measured 1.066x
    vs 1.051x perplexity for 8 bits on SmolLM2, 1.105x vs 1.089x on Gemma-3, and reads half the bytes per token:
    SmolLM2 decode 144-157 vs 104-143 tok/s, and Gemma-3's 262k-token head is most of its weights). ``accuracy_level`` 4 selects ONNX Runtime's
    int8-compute kernels (the only fast ones). ``keep_fp32``: node-name patterns (glob or substring; ``lm_head``
    names the LM head) left unquantized; ``include`` (if given) limits quantization to matching nodes;
    ``exclude`` is the same as ``keep_fp32``. ``calibration`` configures the data and calibrator for ``gptq`` and
    ``int8-static``. ``act_order`` and ``scale_search`` (gptq): quantize input features in order of decreasing
    Hessian diagonal (block scales fixed up front, so the layout stays contiguous) and pick each block's scale
    among shrunk candidates by weighted error (measured on SmolLM2/Gemma-3: 1.127/1.160x -> 1.055/1.089x
    perplexity). ``pack`` merges weight-only MatMuls that read one input (q/k/v, gate/up) into one.
    ``smooth_alpha`` (int8-static): SmoothQuant's migration strength, ``s_j = max|X_j|^alpha /
    max|W_j|^(1-alpha)`` per input channel of every quantized GEMM (see
    :mod:`trtinfer.quantization.smoothquant`; 0.7 measured best of 0.3-0.9 on SmolLM2 and Gemma-3); None turns
    smoothing off.
    """

    precision: str = "int4"
    method: str = "gptq"
    block_size: int | None = None
    symmetric: bool = True
    lm_head_bits: int = 4
    accuracy_level: int = 4
    keep_fp32: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    calibration: Any = field(default=None)
    pack: bool = True
    act_order: bool = True
    scale_search: bool = True
    smooth_alpha: float | None = 0.7

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"quantized precision must be one of {', '.join(PRECISIONS)}, got '{self.precision}'")
        if self.method not in METHODS:
            raise ConfigError(f"--method must be one of {', '.join(METHODS)}, got '{self.method}'")
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or self.block_size < 16 or self.block_size & (self.block_size - 1)):
            raise ConfigError(f"--block-size must be a power of 2 >= 16, got {self.block_size}")
        if self.lm_head_bits not in (4, 8):
            raise ConfigError(f"--lm-head-bits must be 4 or 8, got {self.lm_head_bits} (use --keep-fp32 lm_head "
                              "to leave it unquantized)")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConfigError(f"accuracy_level must be 0..4, got {self.accuracy_level}")
        for name in ("keep_fp32", "include", "exclude"):
            bad = [p for p in getattr(self, name) if not isinstance(p, str) or not p.strip()]
            if bad:
                raise ConfigError(f"--{name.replace('_', '-')} patterns must be non-empty names, got {bad!r}")
        a = self.smooth_alpha
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1):
            raise ConfigError(f"smooth_alpha must be a number in [0, 1] or None (no smoothing), got {a!r}",
                              field="smooth_alpha")
        if self.calibration is None:
            from trtinfer.calibration import CalibrationConfig

            object.__setattr__(self, "calibration", CalibrationConfig())

    @property
    def ort_block(self) -> int:
        """The weight block on ONNX Runtime's MatMulNBits: ``block_size``, 32 when not given."""
        return self.block_size or 32

    @property
    def needs_calibration(self) -> bool:
        """True when this config runs the model on calibration data (GPTQ statistics, static activation ranges)."""
        return self.precision == "int8-static" or (self.precision == "int4" and self.method == "gptq")

    @property
    def skip_patterns(self) -> tuple[str, ...]:
        """Node-name patterns left in fp32."""
        return self.keep_fp32 + self.exclude

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for stage records and cache keys (only the settings this precision uses)."""
        d = asdict(self)
        for k in ("keep_fp32", "include", "exclude"):
            d[k] = list(d[k])
        cal = self.calibration
        d["calibration"] = ({**cal.settings(), "cache_file": None if cal.cache_file is None else str(cal.cache_file)}
                            if self.needs_calibration else None)
        if self.precision != "int4" or self.method != "gptq":
            d.pop("act_order")
            d.pop("scale_search")
        if self.precision != "int4":
            d.pop("method")
        if self.precision != "int8-static":
            d.pop("smooth_alpha")
        if self.precision in ("gguf", "int8-static"):
            for k in ("block_size", "symmetric", "lm_head_bits"):
                d.pop(k)
        return d
