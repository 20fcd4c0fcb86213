"""``int4`` and ``int8`` for ONNX Runtime graphs: weight-only blocks on ``MatMulNBits``, int8 compute.

Every selected MatMul weight becomes symmetric blocks along ``K`` (round-to-nearest, or GPTQ with Hessians of the
MatMul's input over calibration data). The LM head takes ``lm_head_bits`` (8 by default: an int4 LM head costs
accuracy on every token and was reported to make models repeat themselves, ORT #24384); with tied embeddings the
embedding Gather becomes ``GatherBlockQuantized`` on the LM head's own packed weight (one stored copy).
``accuracy_level=4`` is the only fast path (int8 activations, VNNI/AVX2 dot products); symmetric codes avoid ONNX
Runtime's asymmetric int8 batch-1 bug on AVX2 (ORT #29853) and the slow float-zero-point path.
"""
from __future__ import annotations

import logging
from typing import Any

import onnx_ir as ir

from trtinfer.passes.embedding import embedding_gather, tied_embedding
from trtinfer.quantization.gptq import Factor, factor, gptq_columns
from trtinfer.quantization.packing import pack_shared_inputs
from trtinfer.quantization.registry import QuantContext, register_precision
from trtinfer.quantization.weights import (
    BlockCache,
    Blocks,
    LazyBlocks,
    SpilledBlocks,
    WeightSite,
    release,
    replace_gather,
    replace_matmul,
    select_sites,
    weight_sites,
)

log = logging.getLogger(__name__)

ORT = ("onnxruntime-cpu", "onnxruntime-cuda")


def layout_for(site: WeightSite, ctx: QuantContext, bits: int) -> tuple[int, int, bool]:
    """(bits, block, symmetric) of one site: the LM head takes ``lm_head_bits`` and is always symmetric (it may
    serve the embedding's GatherBlockQuantized, which takes no zero points here)."""
    cfg = ctx.config
    block = cfg.ort_block
    while site.k % block and block > 16:
        block //= 2
    if site.lm_head:
        return (cfg.lm_head_bits if bits == 4 else 8), block, True
    return bits, block, cfg.symmetric


def _quantize_sites(model: ir.Model, ctx: QuantContext, bits: int) -> dict[str, Any]:
    graph = model.graph
    vocab = int(ctx.geometry["vocab_size"])
    sites = weight_sites(graph, vocab)
    chosen, kept = select_sites(sites, ctx.config)  # layout_for halves a block that does not divide K
    head = next((s for s in sites if s.lm_head), None)
    gather = embedding_gather(graph, vocab)
    tied = tied_embedding(gather, head.weight if head is not None else None)
    method = ctx.config.method if bits == 4 else "rtn"
    fp32_bytes = sum(4 * s.k * s.n for s in sites)
    cache = BlockCache()
    forms: dict[str, int] = {}
    head_packed: tuple[ir.Value, Blocks] | None = None

    def place(s: WeightSite, hessian: Factor | None) -> None:
        nonlocal head_packed
        b, block, sym = layout_for(s, ctx, bits)
        q: Blocks
        if hessian is not None:
            q = SpilledBlocks(gptq_columns(s.columns, s.k, s.n, hessian, bits=b, block=block, symmetric=sym,
                                           act_order=ctx.config.act_order, scale_search=ctx.config.scale_search),
                              ctx.scratch, cache)  # on disk until the stage is written
            release(s.weight.const_value)  # its mapped pages leave the process: peak stays a chunk, not the model
        else:  # round-to-nearest: computed as the stage is written, one weight at a time
            assert s.weight.const_value is not None
            q = LazyBlocks(s.weight.const_value, b, block, sym, cache)
        _, packed = replace_matmul(graph, s, q, ctx.config.accuracy_level)
        key = f"{b}-bit block {block} {'symmetric' if sym else 'asymmetric'}"
        forms[key] = forms.get(key, 0) + 1
        if s.lm_head:
            head_packed = (packed, q)

    left = {s.name: s for s in chosen}
    if method == "gptq":  # a piece's statistics, then its weights, then the next piece's: one piece's Hessians held
        from trtinfer.quantization.gptq_stats import matmul_hessians

        for hessians in matmul_hessians(ctx, chosen):
            while hessians:  # one factor per input, for every weight reading it (q/k/v, gate/up)
                name, h = hessians.popitem()
                readers = [name, *(n for n, other in hessians.items() if other is h)]
                for n in readers[1:]:
                    del hessians[n]
                f = factor(h, act_order=ctx.config.act_order)
                del h
                for n in readers:
                    place(left.pop(n), f)
                del f
    for s in left.values():
        place(s, None)
    embedding = "fp32"
    if tied and head_packed is not None and gather is not None:
        packed, q = head_packed
        replace_gather(graph, gather, q, packed)
        embedding = f"GatherBlockQuantized sharing the LM head's {q.bits}-bit weight"
    elif head_packed is not None and gather is not None:  # untied: the table takes the LM head's precision
        table = gather.inputs[0]
        assert table is not None and table.const_value is not None
        _, q = head_packed
        replace_gather(graph, gather, LazyBlocks(table.const_value, q.bits, q.block, True, cache, transpose=True))
        embedding = f"GatherBlockQuantized, {q.bits}-bit (the LM head's precision)"
    ir.passes.common.RemoveUnusedNodesPass()(model)
    packing = pack_shared_inputs(graph) if ctx.config.pack else {}
    ir.passes.common.RemoveUnusedNodesPass()(model)
    stored = sum(v.const_value.nbytes for v in graph.initializers.values()  # packed weights, scales, an fp32 table
                 if v.const_value is not None and (v.const_value.dtype == ir.DataType.UINT8 or (v.name or "").endswith(
                     "scales") or gather is not None and embedding == "fp32" and v is gather.inputs[0]))
    calibration = ctx.notes.get("calibration")
    return {"method": method, "quantized": len(chosen), **({"calibration": calibration} if calibration else {}), "matmuls": len(sites), "forms": forms,
            "kept": kept, "tied_embedding": tied, "embedding": embedding,
            "accuracy_level": ctx.config.accuracy_level,
            "weight_bytes_fp32": fp32_bytes, "weight_bytes": stored, "packing": packing}


@register_precision("int4", targets=ORT)
def int4_weight_only(model: ir.Model, ctx: QuantContext) -> dict[str, Any]:
    """4-bit symmetric MatMulNBits blocks (RTN or GPTQ), LM head at lm_head_bits, int8 compute."""
    return _quantize_sites(model, ctx, 4)


@register_precision("int8", targets=ORT)
def int8_weight_only(model: ir.Model, ctx: QuantContext) -> dict[str, Any]:
    """8-bit symmetric MatMulNBits blocks, int8 compute (accuracy_level 4)."""
    return _quantize_sites(model, ctx, 8)
