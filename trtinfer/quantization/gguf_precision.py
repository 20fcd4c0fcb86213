"""``gguf``: the GGUF source's own quantized blocks, imported exactly onto MatMulNBits / GatherBlockQuantized."""
from __future__ import annotations

from typing import Any

import onnx_ir as ir

from trtinfer.errors import ConfigError
from trtinfer.quantization.packing import pack_shared_inputs
from trtinfer.quantization.registry import QuantContext, register_precision
from trtinfer.quantization.weights import matches


@register_precision("gguf", targets=("onnxruntime-cpu", "onnxruntime-cuda"))
def gguf_blocks(model: ir.Model, ctx: QuantContext) -> dict[str, Any]:
    """Each weight keeps the GGUF file's blocks (4-/8-bit MatMulNBits, block-sum correction for min terms)."""
    from trtinfer.quantization.gguf import gguf_source, import_gguf, stage_origins

    path = gguf_source(ctx.stage)
    origins = stage_origins(ctx.stage)
    if path is None or not origins:
        raise ConfigError(f"{ctx.stage.path} was not exported from a GGUF file (source: "
                          f"{ctx.stage.info.get('source', {}).get('path')}); --precision gguf keeps a GGUF's own "
                          "blocks: use int4 or int8 for other models")
    patterns = ctx.config.skip_patterns
    exclude = (lambda name: matches(name, patterns)) if patterns else None
    # decoder MatMuls read [batch, sequence, K]: block sums reshape by a constant
    report = import_gguf(model, path, origins, accuracy_level=ctx.config.accuracy_level, exclude=exclude, rank_hint=3)
    report["gguf"] = str(path)
    report["packing"] = pack_shared_inputs(model.graph) if ctx.config.pack else {}
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return report
