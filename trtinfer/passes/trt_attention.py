"""Attention in the form TensorRT fuses itself: ``softmax((s*Q) @ K^T + mask) @ V`` on ``[B, heads, S, D]`` tensors.

NVIDIA's "Fused Attention" guide (TensorRT 10) fuses a primitive MatMul-Softmax-MatMul graph when Q is
``[B, N_q, S_q, H]`` and K, V ``[B, N_kv, S_kv, H]`` (GQA when ``N_q % N_kv == 0``), the mask is added before the
Softmax, and the attention scale is applied to Q (or K) *before* the first MatMul. The exporter's core
(``trtinfer.export.wrapper.gqa_attention``) is tuned for CPUs instead: the G query heads of a KV group are folded
into ``G*S`` query rows (K/V read once, no ``repeat_kv``) and the scale multiplies the scores after the MatMul::

    q [B,H,S,D] -Reshape-> [B,KV,G*S,D] -MatMul(present_k^T)-> -Mul(scale)-Reshape(5D)-Add(mask)-Reshape-
        Softmax -MatMul(present_v)-> [B,KV,G*S,D] -Reshape-> [B,H,S,D]

becomes, for the ``tensorrt`` target::

    Mul(q, scale) [B,H,S,D] -MatMul(Transpose(repeat(present_k)))-> Add(mask [B,1,S,T]) -Softmax-
        MatMul(repeat(present_v)) -> [B,H,S,D]

with ``repeat(x) = Reshape(Expand(Unsqueeze(x, 2), [1,1,G,1,1]), [0,H,-1,D])`` (the form TensorRT sees in
transformers' own exports). Same numbers; ``present.*`` outputs are untouched. Not executed on TensorRT here (no GPU):
the form follows the guide, the numbers are checked on ONNX Runtime against the unfused graph.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from trtinfer.passes.attention import PRESENT_KEY, const_array
from trtinfer.passes.registry import PassContext, register_pass

log = logging.getLogger(__name__)


class TensorRtAttention(pattern.RewriteRuleClassBase):
    """Our grouped attention core -> scale-first, ``[B,H,S,D]`` MatMul-Softmax-MatMul with repeated K/V."""

    def __init__(self, geometry: dict[str, Any]) -> None:
        super().__init__("tensorrt_attention", remove_nodes=False)
        self._geo = geometry

    def pattern(self, op: Any, q: Any, present_k: Any, present_v: Any, scale: Any, mask: Any, s1: Any, s2: Any,
                s3: Any, s4: Any) -> Any:
        scores = op.MatMul(op.Reshape(q, s1, _allow_other_attributes=True), op.Transpose(present_k, perm=[0, 1, 3, 2]))
        scores = op.Mul(scores, scale)
        scores = op.Reshape(op.Add(op.Reshape(scores, s2, _allow_other_attributes=True), mask), s3,
                            _allow_other_attributes=True)
        out = op.MatMul(op.Softmax(scores, axis=-1), present_v)
        return op.Reshape(out, s4, _allow_other_attributes=True)

    def check(self, context: Any, present_k: ir.Value, scale: ir.Value, mask: ir.Value,  # type: ignore[override]
              **_: Any) -> Any:
        result = pattern.MatchResult()
        if PRESENT_KEY.match(present_k.name or "") is None or not present_k.is_graph_output():
            return result.fail("the keys are not a present.N.key graph output", present_k)
        s = const_array(scale)
        if s is None or s.size != 1:
            return result.fail("attention scale is not a constant scalar", scale)
        known = mask.shape is not None and isinstance(mask.shape[2] if len(mask.shape) > 2 else None, int)
        if mask.shape is not None and (len(mask.shape) != 5 or (known and mask.shape[2] != 1)):
            return result.fail("mask is not broadcast over the group axis ([B,1,1,S,T])", mask)
        return result

    def rewrite(self, op: Any, q: ir.Value, present_k: ir.Value, present_v: ir.Value, scale: ir.Value,
                mask: ir.Value, **_: Any) -> Any:
        heads, kv, dim = (int(self._geo[k]) for k in ("num_attention_heads", "num_kv_heads", "head_dim"))
        group = heads // kv
        axis2 = op.Constant(value_ints=[2])

        def repeat(x: ir.Value) -> Any:  # [B,KV,T,D] -> [B,H,T,D], each KV head G times in a row
            if group == 1:
                return x
            tiled = op.Expand(op.Unsqueeze(x, axis2), op.Constant(value_ints=[1, 1, group, 1, 1]))
            return op.Reshape(tiled, op.Constant(value_ints=[0, heads, -1, dim]))

        q_scaled = op.Mul(q, op.Constant(value=ir.tensor(np.asarray(const_array(scale)).reshape(()))))
        scores = op.MatMul(q_scaled, op.Transpose(repeat(present_k), perm=[0, 1, 3, 2]))
        scores = op.Add(scores, op.Squeeze(mask, axis2))
        return op.MatMul(op.Softmax(scores, axis=-1), repeat(present_v))


def _expected(ctx: PassContext) -> int | None:
    if ctx.config.target != "tensorrt":
        return 0
    n = ctx.geometry.get("num_layers")
    return int(n) if n else None


@register_pass("tensorrt_attention", kind="fusion", expected=_expected)
def tensorrt_attention(model: ir.Model, ctx: PassContext) -> int:
    """Attention core -> the scale-first [B,H,S,D] MatMul-Softmax-MatMul TensorRT fuses (tensorrt target)."""
    if ctx.config.target != "tensorrt" or not ctx.geometry.get("num_layers"):
        return 0
    return pattern.RewriteRuleSet([TensorRtAttention.rule(geometry=ctx.geometry)]).apply_to_model(model)
