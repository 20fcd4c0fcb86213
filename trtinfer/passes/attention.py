"""Attention for ONNX Runtime: rotary + attention core + KV concat -> one ``GroupQueryAttention`` per layer.

What the exporter traces per layer (``trtinfer.export.wrapper.gqa_attention``, after cleanup)::

    q [B,H,S,D] -rotary(cos,sin)-> q_rot -Reshape-> [B,KV,G*S,D] --MatMul--> scores
    k [B,KV,S,D] -rotary-> k_rot --------+
    past_key_values.i.key ------------------Concat(axis=-2)-> present.i.key -Transpose(0,1,3,2)-^
    scores -Mul(scale)-Reshape-Add(mask)-Reshape-Softmax-MatMul(present.i.value)-Reshape-Transpose-Reshape -> out

becomes::

    [B,S,N*D] views of q, k, v (the projections themselves where q/k/v only split them into heads, else
    Reshape(Transpose)), past k/v, seqlens_k, total_sequence_length,
    cos_cache, sin_cache -> com.microsoft.GroupQueryAttention(do_rotary, scale, local_window_size)
                         -> out [B,S,H*D], present.i.key, present.i.value

The 4D mask is dropped: GQA derives causality, padding (right-padded rows end at ``seqlens_k``) and the sliding
window (``local_window_size`` = the layer's window, same semantics as transformers' ``q - k < window``) itself.
The rotary cos/sin caches are computed by evaluating the graph's own cos/sin subgraph on positions
``0..max_seq_len-1``, so any rope scaling the model uses is preserved exactly.

This is all-or-nothing: a graph is rewritten only if every layer matches, since a half-fused graph would need
both the mask inputs and the seqlens inputs with incompatible padding conventions.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from trtinfer.passes.config import ORT_TARGETS
from trtinfer.passes.registry import PassContext, register_pass

log = logging.getLogger(__name__)

SEQLENS = "seqlens_k"
TOTAL_SEQ = "total_sequence_length"
PRESENT_KEY = re.compile(r"present\.(\d+)\.key$")


def _rotary(op: Any, x: Any, cos: Any, sin: Any, zero: Any, half: Any, end: Any) -> Any:
    """HF ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin``, rotate_half = cat(-x2, x1)."""
    x1 = op.Slice(x, zero, half, _allow_other_inputs=True)
    x2 = op.Slice(x, half, end, _allow_other_inputs=True)
    rotated = op.Concat(op.Neg(x2), x1, axis=-1)
    return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))


def const_array(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``v`` as numpy, or None if it is not a constant."""
    if v is None or v.const_value is None:
        return None
    return np.asarray(v.const_value.numpy())


class CosSinCaches:
    """Evaluates a rotary cos/sin subgraph on positions ``0..n-1`` once and keeps the caches as initializers."""

    def __init__(self, model: ir.Model, max_positions: int) -> None:
        self.model = model
        self.n = max_positions
        self._made: dict[int, tuple[ir.Value, ir.Value] | None] = {}

    def get(self, cos_u: ir.Value, sin_u: ir.Value) -> tuple[ir.Value, ir.Value] | None:
        """``(cos_cache, sin_cache)`` of shape ``[n, D/2]`` for the unsqueezed cos/sin values, or None."""
        key = id(cos_u)
        if key not in self._made:
            self._made[key] = self._make(cos_u, sin_u)
        return self._made[key]

    def _make(self, cos_u: ir.Value, sin_u: ir.Value) -> tuple[ir.Value, ir.Value] | None:
        cos_full, sin_full = _unsqueezed_source(cos_u), _unsqueezed_source(sin_u)
        if cos_full is None or sin_full is None:
            return None
        values = _evaluate_from_positions([cos_full, sin_full], self.n)
        if values is None:
            return None
        caches = []
        for name, arr in zip(("cos_cache", "sin_cache"), values):
            if arr.ndim != 3 or arr.shape[0] != 1 or arr.shape[-1] % 2:
                return None
            d2 = arr.shape[-1] // 2
            first, second = arr[0, :, :d2], arr[0, :, d2:]
            if not np.array_equal(first, second):  # interleaved or partial rotary: not this pattern
                return None
            init = ir.Value(name=f"{name}_{len(self._made)}", const_value=ir.tensor(np.ascontiguousarray(first)))
            init.shape = ir.Shape(first.shape)
            init.dtype = ir.DataType.FLOAT
            self.model.graph.register_initializer(init)
            caches.append(init)
        return caches[0], caches[1]


def _unsqueezed_source(v: ir.Value) -> ir.Value | None:
    """``x`` for ``v = Unsqueeze(x, [1])`` (cos/sin broadcast over heads)."""
    node = v.producer()
    if node is None or node.op_type != "Unsqueeze":
        return None
    axes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None or axes.tolist() not in ([1], 1):
        return None
    return node.inputs[0]


def _dim_of(v: ir.Value | None) -> tuple[ir.Value, int] | None:
    """``(t, i)`` for ``v = Unsqueeze(Gather(Shape(t), i), 0)`` (one dimension of ``t`` as a 1-element tensor)."""
    un = v.producer() if v is not None else None
    if un is None or un.op_type != "Unsqueeze":
        return None
    gather = un.inputs[0].producer() if un.inputs[0] is not None else None
    if gather is None or gather.op_type != "Gather":
        return None
    shape = gather.inputs[0].producer() if gather.inputs[0] is not None else None
    index = const_array(gather.inputs[1])
    if shape is None or shape.op_type != "Shape" or shape.attributes.get("start") is not None or index is None \
            or index.size != 1 or shape.inputs[0] is None:
        return None
    return shape.inputs[0], int(index.reshape(-1)[0])


def flat_source(heads: ir.Value, head_dim: int) -> ir.Value | None:
    """``x [B,S,N*D]`` when ``heads = Transpose(Reshape(x, [B, S, -1, D]), perm=[0,2,1,3])``, else None.

    That is how HF attention splits a projection into heads; GroupQueryAttention takes the projection itself, so
    the split and its inverse both go. Proven structurally: the shape is ``Concat(dim 0 of t, dim 1 of t, -1, D)``
    for the very ``t`` the projection ``x = MatMul(t, W)`` reads, so B and S are ``x``'s own.
    """
    tr = heads.producer()
    if tr is None or tr.op_type != "Transpose" or list(tr.attributes.get_ints("perm", [])) != [0, 2, 1, 3]:
        return None
    rs = tr.inputs[0].producer() if tr.inputs[0] is not None else None
    if rs is None or rs.op_type != "Reshape" or rs.attributes.get_int("allowzero", False):
        return None
    x, shape = rs.inputs[0], rs.inputs[1]
    cat = shape.producer() if shape is not None else None
    proj = x.producer() if x is not None else None
    if cat is None or cat.op_type != "Concat" or len(cat.inputs) != 4 or proj is None or proj.op_type != "MatMul":
        return None
    tail = [const_array(v) for v in cat.inputs[2:]]
    if any(t is None or t.size != 1 for t in tail) or [int(t.reshape(-1)[0]) for t in tail] != [-1, head_dim]:  # type: ignore[union-attr]
        return None
    dims = [_dim_of(v) for v in cat.inputs[:2]]
    if dims[0] is None or dims[1] is None or dims[0] != (proj.inputs[0], 0) or dims[1] != (proj.inputs[0], 1):
        return None
    return x


def _evaluate_from_positions(targets: list[ir.Value], n: int) -> list[np.ndarray] | None:
    """Run the subgraph producing ``targets`` with ``position_ids = [[0..n-1]]``; None if it needs other inputs."""
    import onnx
    import onnxruntime as ort

    nodes: list[ir.Node] = []
    seen: set[int] = set()
    stack = [t.producer() for t in targets]
    graph_inputs: set[str] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        for inp in node.inputs:
            if inp is None:
                continue
            if inp.is_graph_input():
                graph_inputs.add(inp.name or "")
            elif inp.producer() is not None:
                stack.append(inp.producer())
    if graph_inputs != {"position_ids"}:
        return None
    graph = targets[0].graph
    assert graph is not None
    order = {id(nd): i for i, nd in enumerate(graph)}
    nodes.sort(key=lambda nd: order.get(id(nd), 0))
    inits = []
    for nd in nodes:
        for inp in nd.inputs:
            if inp is not None and inp.is_initializer() and inp.const_value is not None:
                inits.append(ir.serde.serialize_tensor(inp.const_value))
                inits[-1].name = inp.name or ""
    proto_nodes = [ir.serde.serialize_node(nd) for nd in nodes]
    out_names = [t.name for t in targets]
    g = onnx.helper.make_graph(
        proto_nodes, "rotary", [onnx.helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, n])],
        [onnx.helper.make_tensor_value_info(str(nm), onnx.TensorProto.FLOAT, None) for nm in out_names],
        initializer=inits)
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in graph.opset_imports.items()]
    m = onnx.helper.make_model(g, opset_imports=opsets, ir_version=9)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    outs = sess.run(out_names, {"position_ids": np.arange(n, dtype=np.int64)[None]})
    return [np.asarray(o, dtype=np.float32) for o in outs]


class GqaFusion(pattern.RewriteRuleClassBase):
    """Rotary + grouped attention core + KV concat of one layer -> ``com.microsoft.GroupQueryAttention``."""

    def __init__(self, name: str, *, rotary: bool, geometry: dict[str, Any], seqlens: ir.Value, total: ir.Value,
                 caches: CosSinCaches) -> None:
        super().__init__(name, remove_nodes=False)
        self._rotary = rotary
        self._geo = geometry
        self._seqlens, self._total, self._caches = seqlens, total, caches

    def pattern(self, op: Any, q_heads: Any, k_heads: Any, v_heads: Any, past_k: Any, past_v: Any, cos_u: Any,
                sin_u: Any, q_zero: Any, q_half: Any, q_end: Any, k_zero: Any, k_half: Any, k_end: Any,
                scale: Any, mask: Any, s1: Any, s2: Any, s3: Any, s4: Any, s5: Any) -> Any:
        # q/k/v arrive as [B,heads,S,D] (usually Transpose(Reshape(proj)); Gemma-3/Qwen3 put a q/k norm between)
        q, k, v = q_heads, k_heads, v_heads
        if self._rotary:
            q = _rotary(op, q, cos_u, sin_u, q_zero, q_half, q_end)
            k = _rotary(op, k, cos_u, sin_u, k_zero, k_half, k_end)
        present_k = op.Concat(past_k, k, axis=-2, _outputs=["present_k"])
        present_v = op.Concat(past_v, v, axis=-2, _outputs=["present_v"])
        scores = op.MatMul(op.Reshape(q, s1, _allow_other_attributes=True), op.Transpose(present_k, perm=[0, 1, 3, 2]))
        scores = op.Mul(scores, scale)
        scores = op.Reshape(op.Add(op.Reshape(scores, s2, _allow_other_attributes=True), mask), s3,
                            _allow_other_attributes=True)
        probs = op.Softmax(scores, axis=-1)
        out = op.MatMul(probs, present_v)
        out = op.Reshape(out, s4, _allow_other_attributes=True)
        out = op.Reshape(op.Transpose(out, perm=[0, 2, 1, 3]), s5, _allow_other_attributes=True)
        return out, present_k, present_v

    def check(self, context: Any, present_k: ir.Value, present_v: ir.Value, past_k: ir.Value, scale: ir.Value,  # type: ignore[override]
              cos_u: ir.Value | None = None, sin_u: ir.Value | None = None,
              **_: Any) -> Any:
        result = pattern.MatchResult()
        m = PRESENT_KEY.match(present_k.name or "")
        if m is None or not present_k.is_graph_output():
            return result.fail("the K concat does not produce a present.N.key graph output", present_k)
        if not past_k.is_graph_input():
            return result.fail("past key is not a graph input", past_k)
        s = const_array(scale)
        if s is None or s.size != 1:
            return result.fail("attention scale is not a constant scalar", scale)
        layer = int(m.group(1))
        if layer >= len(self._geo.get("layer_types", [])):
            return result.fail(f"layer {layer} is not in the model's geometry")
        if self._rotary and (cos_u is None or sin_u is None or self._caches.get(cos_u, sin_u) is None):
            return result.fail("rotary cos/sin do not come from position_ids alone in the non-interleaved form")
        return result

    def rewrite(self, op: Any, q_heads: ir.Value, k_heads: ir.Value, v_heads: ir.Value, past_k: ir.Value,
                past_v: ir.Value, scale: ir.Value, present_k: ir.Value, cos_u: ir.Value | None = None,
                sin_u: ir.Value | None = None, **_: Any) -> Any:
        geo = self._geo
        layer = int(PRESENT_KEY.match(present_k.name or "").group(1))  # type: ignore[union-attr]
        window = geo.get("sliding_window") if geo["layer_types"][layer] == "sliding_attention" else None
        flat = op.Constant(value_ints=[0, 0, -1])

        def bsd(x: ir.Value) -> Any:  # [B,N,S,D] -> [B,S,N*D]: the projection itself when x only split it
            src = flat_source(x, int(geo["head_dim"]))
            return src if src is not None else op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), flat)

        inputs = [bsd(q_heads), bsd(k_heads), bsd(v_heads), past_k, past_v, self._seqlens, self._total]
        if self._rotary:
            cos, sin = self._caches.get(cos_u, sin_u)  # type: ignore[arg-type,misc]
            inputs += [cos, sin]
        return op.GroupQueryAttention(
            *inputs, _domain="com.microsoft", _outputs=3,
            num_heads=int(geo["num_attention_heads"]), kv_num_heads=int(geo["num_kv_heads"]),
            scale=float(const_array(scale).reshape(-1)[0]),  # type: ignore[union-attr]
            local_window_size=int(window) if window else -1, do_rotary=int(self._rotary),
        )


def _seqlens_inputs(model: ir.Model) -> tuple[ir.Value, ir.Value]:
    """The ``seqlens_k [batch] int32`` and ``total_sequence_length [] int32`` graph inputs (added if absent)."""
    graph = model.graph
    found = {v.name: v for v in graph.inputs}
    if SEQLENS in found and TOTAL_SEQ in found:
        return found[SEQLENS], found[TOTAL_SEQ]
    batch = next((v.shape[0] for v in graph.inputs if v.name == "input_ids" and v.shape is not None), "batch")
    seqlens = ir.Value(name=SEQLENS, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([batch]))
    total = ir.Value(name=TOTAL_SEQ, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([]))
    graph.inputs.extend([seqlens, total])
    return seqlens, total


def fuse_gqa(model: ir.Model, geometry: dict[str, Any], max_seq_len: int) -> int:
    """Rewrite every layer's attention into GroupQueryAttention, or nothing; returns the layers rewritten."""
    n_layers = int(geometry.get("num_layers", 0))
    if not n_layers:
        log.warning("attention fusion skipped: the model carries no trtinfer geometry (export it with trtinfer)")
        return 0
    graph = model.graph
    had_inputs = len(graph.inputs)
    seqlens, total = _seqlens_inputs(model)
    caches = CosSinCaches(model, max_seq_len)
    rules = [GqaFusion.rule(f"gqa_rotary_{r}", rotary=r, geometry=geometry, seqlens=seqlens, total=total,
                            caches=caches) for r in (True, False)]
    # dry run: count matches without touching the graph (all-or-nothing)
    matched = 0
    for node in list(graph):
        if node.op_type != "Reshape":
            continue
        for rule in rules:
            if rule.try_rewrite(model, graph, node) is not None:
                matched += 1
                break
    if matched != n_layers:
        log.warning("attention fusion: %d of %d layers match the GroupQueryAttention pattern; leaving attention "
                    "unfused (the engine keeps the growing-KV layout)", matched, n_layers)
        while len(graph.inputs) > had_inputs:
            graph.inputs.pop()
        for init in [v for name, v in graph.initializers.items() if name.startswith(("cos_cache_", "sin_cache_"))]:
            graph.initializers.pop(init.name)  # type: ignore[arg-type]
        return 0
    names = {i: v.name for i, v in enumerate(graph.outputs)}
    fired = pattern.RewriteRuleSet(rules).apply_to_model(model)
    for i, v in enumerate(graph.outputs):  # graph outputs keep their contract names
        if v.name != names[i]:
            v.name = names[i]
    return fired


def _expect_layers(ctx: PassContext) -> int | None:
    n = ctx.geometry.get("num_layers")
    return int(n) if n and ctx.config.target in ORT_TARGETS and not _cuda_fp32(ctx) else (0 if n else None)


def _cuda_fp32(ctx: PassContext) -> bool:
    # ORT's CUDA GroupQueryAttention kernel is fp16/bf16 only
    return ctx.config.target == "onnxruntime-cuda" and ctx.config.precision == "fp32"


@register_pass("attention", kind="fusion", expected=_expect_layers)
def attention(model: ir.Model, ctx: PassContext) -> int:
    """Per layer: rotary + attention + KV concat -> GroupQueryAttention (ORT targets; all layers or none)."""
    if ctx.config.target not in ORT_TARGETS or _cuda_fp32(ctx):
        return 0
    fired = fuse_gqa(model, ctx.geometry, ctx.config.max_seq_len)
    ctx.notes["gqa_layers"] = fired
    return fired


def _expect_rotary(ctx: PassContext) -> int | None:
    n = _expect_layers(ctx)
    if n is None:
        return None
    return 2 * n if ctx.geometry.get("rotary", True) else 0


@register_pass("rotary", kind="fusion", expected=_expect_rotary)
def rotary(model: ir.Model, ctx: PassContext) -> int:
    """Count rotary embeddings absorbed into GroupQueryAttention (q and k per layer; do_rotary=1)."""
    return 2 * sum(1 for n in model.graph if n.op_type == "GroupQueryAttention"
                   and n.attributes.get_int("do_rotary", 0) == 1)
