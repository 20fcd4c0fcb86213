"""``int8-static`` (explicit QDQ, every target) and ``int4`` for the ``tensorrt`` target (DQ-only weight blocks).

int8-static, for each selected MatMul with a constant ``[K, N]`` weight::

    x ──MatMul(W fp32)── y       becomes
    x ──QuantizeLinear(s_x, 0)──DequantizeLinear(s_x, 0)──┐
                          W_q int8 [K,N] ──DequantizeLinear(s_w [N], 0, axis=1)──MatMul── y

Weights are symmetric per output channel (``s_w[n] = max|W[:, n]| / 127``, codes in -127..127, zero point 0).
Activations are symmetric per tensor (``s_x = amax / 127``, zero point 0) with ``amax`` from calibration on real
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

Accuracy on ONNX Runtime CPU, which fuses DQ+MatMul itself (blocked int4 DQ -> ``MatMulNBits`` at accuracy level 4;
int8 QDQ MatMuls -> ``MatMulIntegerToFloat`` where the Q/DQ pair has one reader, float DQ+MatMul where it is
shared: q/k/v and gate/up; separate pairs per reader do not help, ORT's common-subexpression pass merges them). On a QDQ graph
ORT's output equals the numpy fake-quant of the same graph (relative 1e-4), so the distance to fp32 is the
quantization's own. Measured on the tests' tiny random llama (last-position logits of 12 prefill+decode feeds of
held-out text; ``||q - fp32|| / ||fp32||`` and top-1 agreement): int8-static minmax 0.092 / 0.83 (entropy 0.10,
percentile 0.11; weight-only int8 MatMulNBits 0.02 for comparison: per-tensor activations cost the most), TensorRT
int4 block 64 0.26 / 0.50 (ORT int4 block 32: 0.21 / 0.56). Tolerances in ``tests/quantization/test_int8_static.py``:
int8-static < 0.15 and >= 0.75, int4 < 0.35 and >= 0.5 (random tiny weights). Real SmolLM2-135M (slow test, 8
calibration windows of the GFDL, 12 held-out positions): int8-static with every MatMul quantized 0.34 / 0.58, with
``--keep-fp32 down_proj`` 0.16 / 1.00 (the down_proj input, SiLU(gate) * up, holds outliers one per-tensor int8
scale cannot cover; entropy clipping makes it worse, 0.76 / 0.33); TensorRT int4 block 64 0.32 / 0.75.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from trtinfer.errors import ConfigError
from trtinfer.passes.opset import upgrade_opset
from trtinfer.quantization.config import QuantConfig
from trtinfer.quantization.registry import QuantContext, register_precision
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
    scale = (np.abs(w).max(axis=0) / np.float32(127.0)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.clip(np.rint(w / safe), -127, 127).astype(np.int8)
    return codes, scale


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

def activation_ranges(ctx: QuantContext, tensors: Sequence[str]) -> tuple[dict[str, float], dict[str, Any]]:
    """``amax`` of each of ``tensors``, computed on the stage's graph or read from ``calibration.cache_file``
    (checked against the graph; no calibration runs), and the calibration record for the report.

    The table is saved as ``calibration.json`` + ``calibration.cache`` in ``ctx.folder`` either way, so the stage
    carries the scales it used.
    """
    from trtinfer.calibration import calibrate_stage

    cal = ctx.config.calibration
    table = calibrate_stage(ctx.stage, cal, tensors=tensors, progress=ctx.progress)
    reused = cal.cache_file is not None
    table.save(ctx.folder)
    record = {"source": f"file {cal.cache_file}" if reused else "computed", "reused": reused,
              "method": table.method, "dataset_hash": table.dataset_hash, "graph_hash": table.graph_hash,
              "tensors": len(tensors), "settings": table.settings}
    return {t: float(table.ranges[t].amax) for t in tensors}, record


# --- int8-static --------------------------------------------------------------------------------------------------

def quantize_int8_static(model: ir.Model, config: QuantConfig, vocab_size: int,
                         amax: dict[str, float] | None = None, ranges_for: Any = None) -> dict[str, Any]:
    """Rewrite ``model`` in place to explicit QDQ int8 (see the module docstring); returns the report.

    The activation ranges come from ``amax`` (tensor -> amax) or from ``ranges_for(tensor_names) -> (amax,
    record)`` called once with the distinct activation inputs of the selected MatMuls.
    """
    graph = model.graph
    sites = weight_sites(graph, vocab_size)
    chosen, kept = select_sites(sites, config)
    readers: dict[str, list[tuple[ir.Node, int]]] = {}
    values: dict[str, ir.Value] = {}
    for s in chosen:
        x = s.node.inputs[0]
        assert x is not None
        if not x.name:
            raise ConfigError(f"the activation input of {s.name} has no name; int8-static needs named tensors to "
                              "calibrate")
        readers.setdefault(x.name, []).append((s.node, 0))
        values[x.name] = x
    record: dict[str, Any] = {"source": "given", "reused": False, "tensors": len(readers)}
    if amax is None:
        amax, record = ranges_for(list(readers))
    missing = [t for t in readers if t not in amax]
    if missing:
        raise ConfigError(f"no activation range for {len(missing)} MatMul input(s): {', '.join(missing[:3])}; "
                          "calibrate this graph")
    fp32_bytes = sum(s.array().nbytes for s in sites)
    stored = sum(s.array().nbytes for s in sites if s not in chosen)
    scales: dict[str, float] = {}
    for name, consumers in readers.items():
        scale = activation_scale(amax[name])
        insert_activation_qdq(graph, values[name], scale, consumers)
        scales[name] = float(scale)
    for s in chosen:
        codes, w_scale = per_channel_int8(s.array())
        base = (s.weight.name or s.name).replace("/", "_").strip("_")
        q = add_initializer(graph, f"{base}_int8", ir.tensor(codes))
        sc = add_initializer(graph, f"{base}_scale", ir.tensor(w_scale))
        zp = add_initializer(graph, f"{base}_zero_point",
                          ir.tensor(np.zeros(w_scale.shape, np.int8)))
        _weight_dq(graph, s, [q, sc, zp], {"axis": 1}, "DequantizeLinear")
        stored += codes.nbytes + w_scale.nbytes + w_scale.size
    ir.passes.common.RemoveUnusedNodesPass()(model)
    return {"quantized": len(chosen), "matmuls": len(sites), "kept": kept, "activation_qdq": len(readers),
            "weights": "int8 per output channel, symmetric (zero point 0)",
            "activations": "int8 per tensor, symmetric (zero point 0)",
            "calibration": record, "activation_scales": scales,
            "weight_bytes_fp32": fp32_bytes, "weight_bytes": stored}


@register_precision("int8-static", targets=INT8_TARGETS)
def int8_static(model: ir.Model, ctx: QuantContext) -> dict[str, Any]:
    """Explicit QDQ: per-channel int8 weights, per-tensor int8 activations from calibration (TensorRT's form)."""
    report = quantize_int8_static(model, ctx.config, int(ctx.geometry["vocab_size"]),
                                  ranges_for=lambda names: activation_ranges(ctx, names))
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
    fp32_bytes = sum(s.array().nbytes for s in sites)
    stored = sum(s.array().nbytes for s in sites if s not in chosen)
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
