"""``int8-static`` (explicit QDQ, every target) and ``int4`` for the ``tensorrt`` target (DQ-only weight blocks).

int8-static, for each selected MatMul with a constant ``[K, N]`` weight::

    x ──MatMul(W fp32)── y       becomes
    x ──QuantizeLinear(s_x, 0)──DequantizeLinear(s_x, 0)──┐
                          W_q int8 [K,N] ──DequantizeLinear(s_w [N], 0, axis=1)──MatMul── y

Weights are symmetric per output channel (``s_w[n] = max|W[:, n]| / 127``, codes in -127..127, zero point 0).
Activations are symmetric per tensor (``s_x = amax / 127``, zero point 0), SmoothQuant-smoothed (below), with
``amax`` from calibration on real
prefill and decode feeds (:func:`trtinfer.calibration.calibrate_stage`: ``minmax``, ``percentile`` or
``entropy``), or from a saved table (``CalibrationConfig.cache_file``: its graph hash and tensor names are
checked, and no calibration runs). One Q/DQ pair serves each distinct activation tensor (q/k/v read the same
normed ``x``); only the MatMul inputs are rewired to it, every other reader keeps the float tensor.

Placement follows TensorRT's explicit-quantization guide ("Q/DQ Layer-Placement Recommendations",
docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/quantized-types-explicit-quantization.html):
quantize all inputs of weighted operations (Convolution, Deconvolution, GEMM/MatMul: weights and activations);
by default do not quantize the outputs of weighted operations (a trailing Q is kept only where the next layer
consumes int8); do not simulate fusions (batch-norm, activation) in the graph, TensorRT fuses them itself. For
transformers the QDQ policy of NVIDIA ModelOpt's ONNX quantizer (``modelopt.onnx.quantization.qdq_graph``:
``build_non_residual_input_map``, ``remove_partial_input_qdq``) adds: no Q/DQ on the residual input of an Add,
none on LayerNormalization/RMSNorm and Softmax (kept in float for accuracy). Here Q/DQ goes only on the two
inputs of the weight MatMuls, so norms (SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization,
LayerNormalization, ReduceMean/Pow chains), Softmax and residual Adds never read a DQ output; a norm's *output*
feeding a GEMM is quantized, as the GEMM's input.

int4 for ``tensorrt`` (weight-only, TensorRT 10's INT4 form)::

    W_q INT4 [K,N] ──DequantizeLinear(scale [K/B, N] float, axis=0, block_size=B)──MatMul── y

symmetric (no zero point; ``scale = max|block| / 7``, codes in -7..7), ``B`` = 64 or 128 (TensorRT 10 accepts no
other block), default opset raised to 21 (blocked DequantizeLinear and INT4 are opset 21). The upgrade moves the
``axes`` attribute of the Reduce ops that changed at opset 18 into an input and refuses ops whose meaning changed
between the graph's opset and 21 (see :func:`upgrade_opset`).

SmoothQuant (``QuantConfig.smooth_alpha``, default 0.7; :mod:`trtinfer.quantization.smoothquant`) runs first: per
input channel ``s_j = max|X_j|^alpha / max|W_j,:|^(1-alpha)``, ``X / s`` (folded into the RMSNorm gamma, into the
producing up_proj's columns, or an explicit ``Mul``) and ``diag(s) W``; one ``s`` per Q/DQ pair (q/k/v and gate/up
share it). The per-tensor ``amax`` is then that of ``X / s``. Perplexity on 1,024 held-out tokens (the build's
accuracy line; minmax, 16 calibration windows), ratio to fp32:

=================  ========  =====  =====  =====  =====  =====  =====  =====
alpha              none      0.5    0.6    0.65   0.7    0.75   0.8    0.9
=================  ========  =====  =====  =====  =====  =====  =====  =====
SmolLM2-135M       2.462     1.166  1.147  1.037  1.011  1.043  1.059  1.090
Gemma-3-270M       1.487     1.140  1.136         1.049  1.069  1.054
=================  ========  =====  =====  =====  =====  =====  =====  =====

(top-1 agreement at 0.7: 85.0% / 87.8%; without smoothing 48.0% / 67.7%). Gemma-3 sits on the 1.05 target: the
same alpha measured 1.058 once the norm fold also took the q/k/v inputs a ``Shape`` reads (exact in fp32; fp32
rounding alone moved it). The ORT-fused engine graph of SmolLM2 at 0.7 scores 1.018. The massive activations (SmolLM2's
layer-11 down_proj input reaches 3414 where typical values are ~10) sit on a few channels *and* tokens; per-channel
smoothing removes the channel part. A per-layer alpha chosen by each GEMM's fake-quant output error on calibration
rows (ModelOpt's auto-alpha) picked 0.8-0.9 nearly everywhere and measured 1.045 / 1.052: worse than one alpha,
and 60 s slower; not kept.

Weight storage per target: ``tensorrt`` and ``onnxruntime-cuda`` get int8 codes with zero point 0 (TensorRT takes
no other). ``onnxruntime-cpu`` gets the same codes stored as uint8 ``q + 128`` with zero point 128: the same
DequantizeLinear values (the quantize stage's graph scores the same), chosen for the kernel it selects below.

What ONNX Runtime's CPU provider does with the graph (onnxruntime 1.32 source: ``core/optimizer/
graph_transformer_utils.cc``, ``qdq_transformer/qdq_s8_to_u8.cc``, ``qdq_transformer/avx2_weight_s8_to_u8.cc``,
``core/mlas/lib/platform.cpp``, ``qgemm.h``):

- The build's offline optimization (level EXTENDED, saved as the engine graph; the runtime loads it with
  optimizations off, so what the BUILD machine's ORT decided is what every machine runs). On x86
  ``QDQIsInt8Allowed()`` is false, so ``QDQS8ToU8Transformer`` rewrites each int8 activation Q/DQ pair to uint8
  with zero point 128 (codes ``q + 128`` in 1..255). A Q/DQ pair with one MatMul reader becomes
  ``MatMulIntegerToFloat`` (u8 activations, the weights as stored, per-column scales and zero points, int32
  accumulation, float out); a pair shared by q/k/v or gate/up stays ``QuantizeLinear -> DequantizeLinear ->
  MatMul`` in float (exact fake quant; ORT's common-subexpression pass merges separate pairs). SmolLM2: 61
  ``MatMulIntegerToFloat`` (30 o_proj, 30 down_proj, the LM head), 150 float DQ+MatMul.
- ``MlasGemmQuantGetDispatch`` picks by operand types. u8 x s8 (int8 weights) -> ``GemmU8S8Dispatch``; u8 x u8
  (the uint8 weights written here) -> ``GemmU8U8Dispatch``. Per instruction set:

  =====================  ===========================================  ==========================================
  CPU                    U8S8 (int8 weights)                          U8U8 (uint8 weights, written here)
  =====================  ===========================================  ==========================================
  AVX2 (+FMA)            ``MlasGemmU8S8KernelAvx2``: ``vpmaddubsw``    ``MlasGemmU8U8KernelAvx2``: operands
                         adds each pair of adjacent-K u8*s8 products   widened to int16, ``vpmaddwd`` adds pairs
                         into int16 **with saturation** (255*127*2 =   into int32 (at most 2*255*255): exact
                         64770 clips at 32767): WRONG
  AVX-512 BW, no VNNI    ``MlasGemmU8S8KernelAvx512Core``:             ``MlasGemmU8U8KernelAvx512Core``
                         ``vpmaddubsw``, saturates: WRONG              (``vpmaddwd``): exact
  AVX-512 VNNI           ``MlasGemmU8S8KernelAvx512Vnni``              ``MlasGemmU8U8KernelAvx512Core``: exact
                         (``vpdpbusds``, int32): exact                 (no VNNI kernel for u8 x u8)
  AVX-VNNI (no AVX-512)  ``MlasGemmU8S8KernelAvxVnni``: exact          ``MlasGemmU8U8KernelAvx2``: exact; with
                                                                       AVX-VNNI-INT8 ``...DispatchAvx2Vnni``
                                                                       (``vpdpbuud``): exact
  AMX (AMX-TILE/INT8)    ``MlasGemmU8S8DispatchAmx`` (``tdpbusd``):    the AVX-512 kernel above: exact
                         exact
  =====================  ===========================================  ==========================================

  (onnxruntime 1.23-1.24 also sent U8U8 to the AMX U8S8 dispatch, a bug fixed by 1.25 (PR #27671); 1.32 does
  not.) So int8 weights were right only on VNNI/AMX CPUs: an engine built and checked on one was wrong on an
  AVX2-only or AVX-512-without-VNNI CPU (emulating ``vpmaddubsw`` on 64 calibration rows per GEMM of smoothed
  SmolLM2: 1e-5 of the pairs saturate, but 189 of 211 GEMMs see at least one, the worst, layers.5 o_proj, off by
  46% of its largest accumulator). uint8 weights are exact on every x86 CPU, whichever machine built the engine.
- ORT's own remedy, ``session.x64quantprecision=1`` (``Avx2WeightS8ToU8Transformer``: the fused nodes' int8
  weights -> uint8 + 128 where a code lies outside -64..64), does the same rewrite, but only inside a level-2
  optimization and only where ``MlasPlatformU8S8Overflow()`` (U8U8 and U8S8 dispatch tables differ: every x86
  with AVX2, VNNI or not). Set at load time it does nothing here (the engine is loaded with optimizations off),
  and it would not cover an engine graph optimized on a machine where it was not set: hence the form is written
  into the graph. 7-bit weights (-63..63: 2*255*63 fits int16) would avoid the saturation too, at a cost in
  accuracy on every CPU.
- Cost on an AVX-512 VNNI CPU (AMD EPYC Zen 4, 2 threads), where U8U8 gives up the VNNI kernel: one fused
  ``MatMulIntegerToFloat`` at batch 1, best of 30x20 runs, uint8 / int8 weights: 576x1536 30.7 / 25.7 us (x1.20),
  1536x576 27.8 / 22.5 us (x1.24), LM head 576x49152 5.51 / 4.75 ms (x1.16); only the 61 fused GEMMs of
  SmolLM2 pay it (the 150 float DQ+MatMul do not): end to end, SmolLM2 bs1 decode 2.2 vs 2.3 tok/s best of 3,
  within the noise of a loaded machine. On AVX2 and AVX-512 without VNNI not measured (no such CPU here): the
  U8U8 kernel multiplies int16-widened pairs (``vpmaddwd``) where U8S8 multiplies byte quads, so expect a
  per-GEMM cost of the same order, paid for results that are right instead of saturated. ``tests/quantization/test_int8_static.py::test_written_form_is_exact_under_avx2`` emulates the AVX2 /
  AVX-512BW kernels in numpy on the ORT-optimized graph of each target's form at full-range codes (uint8:
  equal to the exact product; int8: off by tens of percent), whatever CPU runs it;
  ``test_ort_integer_kernel_is_exact_at_full_range`` runs the real kernel of the CPU it lands on.

On a QDQ graph ORT's output equals the numpy fake-quant of the same graph (relative 1e-4): the distance to fp32 is
the quantization's own. Tiny random llama of the tests (last-position logits of 12 prefill+decode feeds of held-out
text; ``||q - fp32|| / ||fp32||`` and top-1 agreement): int8-static minmax 0.092 / 0.83 without smoothing, 0.152
with alpha 0.7 (random weights have no outlier channels: smoothing only moves range into the weights); TensorRT
int4 block 64 0.26 / 0.50 (ORT int4 block 32: 0.21 / 0.56).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from trtinfer.calibration.calibrators import ChannelRange
from trtinfer.errors import ConfigError
from trtinfer.passes.opset import upgrade_opset
from trtinfer.quantization.config import QuantConfig
from trtinfer.quantization.registry import QuantContext, register_precision
from trtinfer.quantization.smoothquant import (
    fold_place,
    group_by_input,
    smooth,
    smoothing_factors,
)
from trtinfer.quantization.weights import WeightSite, add_initializer, select_sites, weight_sites

log = logging.getLogger(__name__)

INT8_TARGETS = ("onnxruntime-cpu", "onnxruntime-cuda", "tensorrt")
#: the INT4 block sizes TensorRT 10 compiles
TRT_INT4_BLOCKS = (64, 128)
#: blocked DequantizeLinear and the INT4 type need this default-domain opset
INT4_OPSET = 21
#: the smallest scale written (as the TensorRT table does): a zero scale divides by zero in QuantizeLinear
MIN_SCALE = 1.1754944e-38


# --- weight and activation quantization ---------------------------------------------------------------------------

def per_channel_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``W [K, N]`` -> (int8 codes ``[K, N]`` in -127..127, float32 scales ``[N]`` = ``max|W[:, n]| / 127``)."""
    w = np.asarray(w, dtype=np.float32)
    scale = (np.maximum(w.max(axis=0), -w.min(axis=0)) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = w / safe  # the one float temporary (an LM head's is 671 MB at Gemma-3's vocabulary)
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8), scale


def blocked_int4(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``W [K, N]`` -> (int4 codes ``[K, N]`` in -7..7, float32 scales ``[K/block, N]`` = ``max|block| / 7``)."""
    w = np.asarray(w, dtype=np.float32)
    k, n = w.shape
    if k % block:
        raise ConfigError(f"block size {block} does not divide the weight's {k} input features")
    wb = w.reshape(k // block, block, n)
    scale = (np.abs(wb).max(axis=1) / np.float32(7.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))[:, None, :]
    codes = np.clip(np.rint(wb / safe), -7, 7).reshape(k, n).astype(np.int8)
    return codes.astype(ml_dtypes.int4), scale


#: how the int8 weight codes are stored, per ``quantize_int8_static(weight_type=...)``
WEIGHT_TYPES = {"int8": "int8 per output channel, symmetric (zero point 0)",
                "uint8": "int8 per output channel, symmetric, stored as uint8 codes + 128 with zero point 128 (ONNX "
                         "Runtime's exact U8U8 kernels on every x86 CPU)"}
#: targets whose weights are not stored as int8 (TensorRT takes zero point 0 only; ORT's CUDA provider runs int8)
WEIGHT_TYPE_BY_TARGET = {"onnxruntime-cpu": "uint8"}


def weight_codes(codes: np.ndarray, weight_type: str) -> tuple[np.ndarray, int]:
    """Symmetric int8 codes -> (the codes stored as ``weight_type``, their zero point): ``int8`` as is with zero
    point 0, ``uint8`` as ``codes + 128`` with zero point 128 (``DequantizeLinear`` gives the same values)."""
    if weight_type == "uint8":
        return (codes.astype(np.int16) + 128).astype(np.uint8), 128
    return codes.astype(np.int8), 0


def activation_scale(amax: float) -> np.float32:
    """Per-tensor scale ``amax / 127`` (as the TensorRT table writes it, so a reused table gives the same bits)."""
    return np.float32(max(float(amax) / 127.0, MIN_SCALE))



def _weight_dq(graph: ir.Graph, site: WeightSite, inputs: list[ir.Value], attributes: dict[str, int],
               suffix: str) -> ir.Node:
    """Put ``DequantizeLinear(inputs; attributes)`` in front of ``site``'s MatMul as its weight."""
    base = site.node.name or f"{site.weight.name or 'w'}/MatMul"
    dq = ir.node("DequantizeLinear", inputs, attributes=attributes, name=f"{base}/weight_{suffix}")
    out = dq.outputs[0]
    out.name, out.shape, out.type = f"{base}/weight_{suffix}_output_0", site.weight.shape, \
        ir.TensorType(ir.DataType.FLOAT)
    graph.insert_before(site.node, dq)
    site.node.replace_input_with(1, out)
    return dq


def insert_activation_qdq(graph: ir.Graph, x: ir.Value, scale: np.float32, consumers: Sequence[tuple[ir.Node, int]]) -> tuple[ir.Node, ir.Node]:
    """``x -> QuantizeLinear -> DequantizeLinear`` (per tensor, int8 zero point 0) read by ``consumers`` only.

    The pair goes before the first consumer in graph order; other readers of ``x`` keep the float tensor.
    """
    base = (x.name or "x").rstrip("_")
    s = add_initializer(graph, f"{base}_scale", ir.tensor(np.array(scale, np.float32)))
    zp = add_initializer(graph, f"{base}_zero_point", ir.tensor(np.array(0, np.int8)))
    q = ir.node("QuantizeLinear", [x, s, zp], name=f"{base}_QuantizeLinear")
    dq = ir.node("DequantizeLinear", [q.outputs[0], s, zp], name=f"{base}_DequantizeLinear")
    q.outputs[0].name, q.outputs[0].shape = f"{base}_quantized", x.shape
    q.outputs[0].type = ir.TensorType(ir.DataType.INT8)
    dq.outputs[0].name, dq.outputs[0].shape, dq.outputs[0].type = f"{base}_dequantized", x.shape, x.type
    order = {id(n): i for i, n in enumerate(graph)}
    first = min((n for n, _ in consumers), key=lambda n: order[id(n)])
    graph.insert_before(first, [q, dq])
    for node, idx in consumers:
        node.replace_input_with(idx, dq.outputs[0])
    return q, dq


# --- calibration --------------------------------------------------------------------------------------------------

def activation_ranges(ctx: QuantContext, tensors: Sequence[str], smoothing: Any = None,
                      smoothed_names: dict[str, str] | None = None,
                      ) -> tuple[dict[str, float], dict[str, Any], dict[str, np.ndarray]]:
    """``amax`` of each of ``tensors`` (of ``x / s`` with ``smoothing``, see
    :func:`trtinfer.calibration.calibrate_stage`), computed on the stage's graph or read from
    ``calibration.cache_file`` (checked against the graph; no calibration runs), the calibration record for the
    report, and the smoothing factors (empty without smoothing).

    The table is saved as ``calibration.json`` + ``calibration.cache`` in ``ctx.folder`` either way, so the stage
    carries the scales it used; its tensor names are those the written graph quantizes (``smoothed_names``).
    """
    from trtinfer.calibration import calibrate_stage

    cal = ctx.config.calibration
    table = calibrate_stage(ctx.stage, cal, tensors=tensors, progress=ctx.progress, smoothing=smoothing,
                            smoothed_names=smoothed_names, smoothing_info={"alpha": ctx.config.smooth_alpha})
    reused = cal.cache_file is not None
    table.save(ctx.folder)
    record = {"source": f"file {cal.cache_file}" if reused else "computed", "reused": reused,
              "method": table.method, "dataset_hash": table.dataset_hash, "graph_hash": table.graph_hash,
              "tensors": len(tensors), "settings": table.settings}
    names = {t: (smoothed_names or {}).get(t, t) if smoothing else t for t in tensors}
    factors = ({t: np.asarray(table.smoothing["factors"][t], np.float32) for t in tensors}
               if smoothing and table.smoothing else {})
    return {t: float(table.ranges[names[t]].amax) for t in tensors}, record, factors


# --- int8-static --------------------------------------------------------------------------------------------------

def quantize_int8_static(model: ir.Model, config: QuantConfig, vocab_size: int,
                         amax: dict[str, float] | None = None, ranges_for: Any = None,
                         channels: dict[str, ChannelRange] | None = None,
                         weight_type: str = "int8") -> dict[str, Any]:
    """Rewrite ``model`` in place to explicit QDQ int8 (see the module docstring); returns the report.

    The activation ranges come from ``amax`` (tensor -> amax of the fp32 tensor) or from
    ``ranges_for(tensor_names, smoothing, smoothed_names) -> (amax, record, factors)`` called once with the
    distinct activation inputs of the selected MatMuls (:func:`activation_ranges`). With ``config.smooth_alpha``
    the activations are smoothed first (:mod:`trtinfer.quantization.smoothquant`); given ranges then need
    ``channels`` (tensor -> per-channel range), from which the smoothed ``amax`` follows (minmax).
    ``weight_type``: ``int8`` (zero point 0, TensorRT's form) or ``uint8`` (the same codes + 128, zero point 128:
    the same values, and the form ONNX Runtime's CPU provider multiplies exactly on every x86 CPU; see
    :func:`weight_codes`).
    """
    if weight_type not in WEIGHT_TYPES:
        raise ConfigError(f"weight_type must be one of {', '.join(WEIGHT_TYPES)}, got {weight_type!r}")
    graph = model.graph
    sites = weight_sites(graph, vocab_size)
    chosen, kept = select_sites(sites, config)
    groups = group_by_input(chosen)
    alpha = config.smooth_alpha
    producers = {id(s.node): s for s in sites}
    places = {n: fold_place(g, producers) for n, g in groups.items()} if alpha is not None else {}
    smoothed_names = {n: f"{n}_smoothed" if places.get(n) == "mul" else n for n in groups}

    def factors_for(ch: dict[str, ChannelRange]) -> dict[str, np.ndarray]:
        assert alpha is not None
        return {n: smoothing_factors(ch[n].amax, g.weight_row_amax(), alpha) for n, g in groups.items()}

    factors: dict[str, np.ndarray] = {}
    record: dict[str, Any] = {"source": "given", "reused": False, "tensors": len(groups)}
    if amax is None:
        amax, record, factors = ranges_for(list(groups), factors_for if alpha is not None else None,
                                           smoothed_names)
    elif alpha is not None:
        if channels is None:
            raise ConfigError("smoothing (smooth_alpha) needs the per-channel ranges of the MatMul inputs; give "
                              "channels= or set smooth_alpha=None", field="smooth_alpha")
        factors = factors_for(channels)
        amax = {n: channels[n].divided(factors[n]).amax for n in groups}
    missing = [t for t in groups if t not in amax]
    if missing:
        raise ConfigError(f"no activation range for {len(missing)} MatMul input(s): {', '.join(missing[:3])}; "
                          "calibrate this graph")
    fp32_bytes = sum(s.nbytes for s in sites)
    stored = sum(s.nbytes for s in sites if s not in chosen)
    quantized_input, folds = smooth(graph, groups, factors, sites)
    scales: dict[str, float] = {}
    for name, group in groups.items():
        scale = activation_scale(amax[name])
        insert_activation_qdq(graph, quantized_input[name], scale, [(g.node, 0) for g in group.gemms])
        scales[smoothed_names[name]] = float(scale)
    for s in chosen:
        codes, w_scale = per_channel_int8(s.array())
        codes, zero = weight_codes(codes, weight_type)
        base = (s.weight.name or s.name).replace("/", "_").strip("_")
        q = add_initializer(graph, f"{base}_{weight_type}", ir.tensor(codes))
        sc = add_initializer(graph, f"{base}_scale", ir.tensor(w_scale))
        zp = add_initializer(graph, f"{base}_zero_point", ir.tensor(np.full(w_scale.shape, zero, codes.dtype)))
        _weight_dq(graph, s, [q, sc, zp], {"axis": 1}, "DequantizeLinear")
        stored += codes.nbytes + w_scale.nbytes + w_scale.size
    ir.passes.common.RemoveUnusedNodesPass()(model)
    smoothing = None
    if factors:
        top = max(factors, key=lambda n: float(factors[n].max()))
        smoothing = {"alpha": alpha, "folded": folds, "max_factor": round(float(factors[top].max()), 3),
                     "max_factor_tensor": top}
    return {"quantized": len(chosen), "matmuls": len(sites), "kept": kept, "activation_qdq": len(groups),
            "weights": WEIGHT_TYPES[weight_type],
            "activations": "int8 per tensor, symmetric (zero point 0)", "smoothing": smoothing,
            "calibration": record, "activation_scales": scales,
            "weight_bytes_fp32": fp32_bytes, "weight_bytes": stored}


@register_precision("int8-static", targets=INT8_TARGETS)
def int8_static(model: ir.Model, ctx: QuantContext) -> dict[str, Any]:
    """Explicit QDQ: per-channel int8 weights, per-tensor int8 activations from calibration (TensorRT's form)."""
    report = quantize_int8_static(model, ctx.config, int(ctx.geometry["vocab_size"]),
                                  ranges_for=lambda *a: activation_ranges(ctx, *a),
                                  weight_type=WEIGHT_TYPE_BY_TARGET.get(ctx.target, "int8"))
    report["target"] = ctx.target
    return report


# --- int4 for TensorRT --------------------------------------------------------------------------------------------

def trt_int4_block(config: QuantConfig) -> int:
    """The block of TensorRT's INT4 weights: ``config.block_size`` when 64 or 128, 128 when not given; any other
    size (an explicit 32 included) is refused."""
    if config.block_size is None:
        return 128
    if config.block_size in TRT_INT4_BLOCKS:
        return config.block_size
    raise ConfigError(f"TensorRT 10 compiles INT4 weight blocks of 64 or 128 only, got --block-size "
                      f"{config.block_size}; give --block-size 64 or 128", field="block_size")


@register_precision("int4", targets=("tensorrt",))
def int4_tensorrt(model: ir.Model, ctx: QuantContext) -> dict[str, Any]:
    """DQ-only symmetric INT4 weight blocks (64/128, opset 21): the weight-only form TensorRT 10 compiles."""
    from trtinfer.passes.trt_support import unsupported_ops

    block = trt_int4_block(ctx.config)
    graph = model.graph
    sites = weight_sites(graph, int(ctx.geometry["vocab_size"]))
    chosen, kept = select_sites(sites, ctx.config, block)
    fp32_bytes = sum(s.nbytes for s in sites)
    stored = sum(s.nbytes for s in sites if s not in chosen)
    for s in chosen:
        codes, scale = blocked_int4(s.array(), block)
        base = (s.weight.name or s.name).replace("/", "_").strip("_")
        q = add_initializer(graph, f"{base}_int4", ir.tensor(codes, dtype=ir.DataType.INT4))
        sc = add_initializer(graph, f"{base}_scale", ir.tensor(scale))
        _weight_dq(graph, s, [q, sc], {"axis": 0, "block_size": block}, "DequantizeLinear")
        stored += codes.size // 2 + scale.nbytes
    ir.passes.common.RemoveUnusedNodesPass()(model)
    upgraded = upgrade_opset(model, INT4_OPSET)
    unsupported = unsupported_ops(model)
    if unsupported:
        log.warning("ops TensorRT cannot parse in the int4 graph: %s", unsupported)
    method = "rtn"
    if ctx.config.method != "rtn":
        log.info("int4 for tensorrt rounds to nearest (%s is not implemented for the TensorRT form)",
                 ctx.config.method)
    return {"method": method, "quantized": len(chosen), "matmuls": len(sites), "kept": kept, "block_size": block,
            "form": f"DequantizeLinear(INT4 [K,N], scale [K/{block},N], axis=0, block_size={block}), symmetric",
            "opset": model.opset_imports[""], "opset_upgrade": upgraded, "trt_unsupported_ops": unsupported,
            "weight_bytes_fp32": fp32_bytes, "weight_bytes": stored}
