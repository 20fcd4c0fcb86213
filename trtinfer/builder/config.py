"""Build stage configuration."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trtinfer.errors import ConfigError
from trtinfer.export.config import ExportConfig
from trtinfer.passes.config import DEFAULT_KEEP_FP32, check_keep_fp32
from trtinfer.quantization.config import PRECISIONS as QUANT_PRECISIONS
from trtinfer.quantization.config import QuantConfig
from trtinfer.stages import default_max_seq_len

FLOAT_PRECISIONS = ("fp32", "fp16", "bf16")
PRECISIONS = FLOAT_PRECISIONS + QUANT_PRECISIONS
TARGETS = ("cpu", "cuda")
TENSORRT_PRECISIONS = ("fp32", "fp16", "bf16", "int8-static", "int4")


#: ``--prefill`` kinds: a second graph for passes of several tokens (:mod:`trtinfer.builder.prefill_graph`)
PREFILL_KINDS = ("int8",)
#: the decoder's GEMM op per engine precision, the one an int8 prefill graph rewrites; other precisions have none
PREFILL_GEMM_OPS = {"fp32": ("MatMul", "FusedMatMul"), "int4": ("MatMulNBits",), "int8": ("MatMulNBits",), "gguf": ("MatMulNBits",)}


@dataclass(frozen=True)
class BuildConfig:
    """Settings of :func:`trtinfer.builder.build`.

    ``max_seq_len=None`` takes the model's ``max_position_embeddings`` capped at 4096.
    ``target`` is the execution provider the passes and ONNX Runtime's offline optimization are done for.
    ``precision``: fp32 (default), fp16 or bf16 (GPU targets: ONNX Runtime's CPU kernels have no bf16 and are slower
    in fp16 than fp32; a cpu fp16 build is for checking numerics). ``keep_fp32`` names the groups kept in fp32 by
    fp16/bf16 builds (norms, softmax, residual, logits, lm_head); ``keep_io_types`` keeps KV inputs/outputs fp32.
    ``disable_passes`` names pipeline passes to skip (``trtinfer optimize --list`` shows them).
    ``precision`` int4/int8/int8-static/gguf runs the quantize stage on the fp32 graph (settings in
    ``quantization``, a :class:`~trtinfer.quantization.QuantConfig`; defaults when None).

    TensorRT (``backend="tensorrt"``, implies ``target="cuda"``): ``opt_batch_size``/``opt_seq_len`` are the shapes
    its optimization profiles are tuned for (defaults: max batch capped at 8, max sequence capped at 512);
    ``workspace_mib`` caps the builder's scratch memory (default 4096); ``timing_cache`` is the timing cache file
    reused across builds (default: one per TensorRT version and GPU under the trtinfer cache). Precisions: fp32,
    fp16, bf16 (strongly typed from the graph), int8-static and int4 (Q/DQ graphs).

    ``max_perplexity_ratio``: a quantized engine's perplexity on the held-out text over the fp32 graph's, above which
    the build fails (None: the precision's bound, :data:`trtinfer.quantization.accuracy.PERPLEXITY_BOUNDS`); the
    manifest records the bound and who set it.

    ``reduced_depth_check``: where the model's fp32 graph does not fit (no eager validation, no engine-check
    reference), check the pipeline on a build of its first layers (:mod:`trtinfer.builder.piece_check`); off, the
    engine is not checked at all (the manifest says so).

    ``prefill="int8"`` (ONNX Runtime on the CPU; fp32, int4, int8 and gguf engines) adds a prefill graph whose GEMMs
    run on int8 activations (per token) and int8 weights: prompts prefill 2-3x faster for one int8 copy of the GEMM
    weights more in memory; the build scores it against the decoder alone and fails past
    :data:`~trtinfer.builder.check.PREFILL_BOUND`.
    """

    backend: str = "onnxruntime"
    precision: str = "fp32"
    target: str = "cpu"
    max_batch_size: int = 16
    max_seq_len: int | None = None
    keep_io_types: bool = False
    keep_fp32: tuple[str, ...] = DEFAULT_KEEP_FP32
    disable_passes: tuple[str, ...] = ()
    export: ExportConfig = field(default_factory=ExportConfig)
    quantization: QuantConfig | None = None
    opt_batch_size: int | None = None
    opt_seq_len: int | None = None
    workspace_mib: int | None = None
    timing_cache: str | None = None
    max_perplexity_ratio: float | None = None
    reduced_depth_check: bool = True
    prefill: str | None = None

    def __post_init__(self) -> None:
        if self.prefill is not None:
            if self.prefill not in PREFILL_KINDS:
                raise ConfigError(f"--prefill must be one of {', '.join(PREFILL_KINDS)}, got {self.prefill!r}",
                                  field="prefill")
            if self.backend != "onnxruntime" or self.target != "cpu" or self.precision not in PREFILL_GEMM_OPS:
                raise ConfigError(f"--prefill {self.prefill} is for ONNX Runtime CPU engines of precision "
                                  f"{', '.join(PREFILL_GEMM_OPS)}, not {self.backend}/{self.target} {self.precision}; "
                                  "drop --prefill", field="prefill")
        if self.max_perplexity_ratio is not None:
            if isinstance(self.max_perplexity_ratio, bool) or not isinstance(self.max_perplexity_ratio, (int, float)) \
                    or not self.max_perplexity_ratio >= 1.0:
                raise ConfigError(f"--max-perplexity-ratio must be a number >= 1 (engine perplexity / fp32 "
                                  f"perplexity), got {self.max_perplexity_ratio!r}", field="max_perplexity_ratio")
            if self.precision not in QUANT_PRECISIONS:
                raise ConfigError(f"--max-perplexity-ratio bounds quantized engines ({', '.join(QUANT_PRECISIONS)}); "
                                  f"a {self.precision} build has no accuracy check to bound", field="max_perplexity_ratio")
        if self.backend == "tensorrt":
            if self.target == "cpu":  # the default: TensorRT engines run on the GPU, whatever was left unsaid
                object.__setattr__(self, "target", "cuda")
            if self.precision not in TENSORRT_PRECISIONS:
                raise ConfigError(f"--backend tensorrt builds {', '.join(TENSORRT_PRECISIONS)}, not {self.precision} "
                                  "(an ONNX Runtime CPU form); use one of those or --backend onnxruntime")
        for name in ("opt_batch_size", "opt_seq_len", "workspace_mib"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        if self.opt_batch_size is not None and self.opt_batch_size > self.max_batch_size:
            raise ConfigError(f"--opt-batch-size {self.opt_batch_size} exceeds --max-batch-size {self.max_batch_size}",
                              field="opt_batch_size")
        if self.opt_seq_len is not None and self.max_seq_len is not None and self.opt_seq_len > self.max_seq_len:
            raise ConfigError(f"--opt-seq-len {self.opt_seq_len} exceeds --max-seq-len {self.max_seq_len}",
                              field="opt_seq_len")
        if self.precision in QUANT_PRECISIONS:
            if self.quantization is None:
                object.__setattr__(self, "quantization", QuantConfig(precision=self.precision))
            elif self.quantization.precision != self.precision:
                raise ConfigError(f"precision {self.precision} but quantization settings for "
                                  f"{self.quantization.precision}; give one precision")
        elif self.quantization is not None:
            raise ConfigError(f"quantization settings need a quantized precision ({', '.join(QUANT_PRECISIONS)}), "
                              f"not {self.precision}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision '{self.precision}' is not available in this version; supported: "
                              f"{', '.join(PRECISIONS)}")
        if self.precision == "bf16" and self.target == "cpu" and self.backend != "tensorrt":
            raise ConfigError("bf16 needs a GPU target: ONNX Runtime's CPU provider has no bf16 kernels; "
                              "use --target cuda, or --precision fp16 to check reduced-precision numerics on CPU")
        check_keep_fp32(self.keep_fp32, "--keep-fp32")
        if self.target not in TARGETS:
            raise ConfigError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")

    @property
    def pass_precision(self) -> str:
        """The precision the optimize stage converts to: fp32 under a quantized precision."""
        return "fp32" if self.quantization is not None else self.precision

    def max_seq_len_for(self, geometry: dict[str, Any]) -> int:
        """The engine's max sequence length: ``max_seq_len``, else the model's positions capped at 4096."""
        return self.max_seq_len or default_max_seq_len(geometry)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the manifest."""
        d = asdict(self)
        d["disable_passes"] = list(self.disable_passes)
        d["keep_fp32"] = list(self.keep_fp32)
        d["quantization"] = None if self.quantization is None else self.quantization.to_dict()
        return d
