"""The quantize stage: optimized fp32 graph -> int4 / int8 / int8-static / gguf graph (see :mod:`.stage`)."""
from trtinfer.quantization.config import PRECISIONS, QuantConfig
from trtinfer.quantization.stage import quantize_cached, quantize_stage

__all__ = ["PRECISIONS", "QuantConfig", "quantize_cached", "quantize_stage"]
