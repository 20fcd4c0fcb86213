"""An int8 prefill graph beside a CPU engine's decoder: the same model, its GEMMs on int8 activations and weights.

A prompt's prefill is compute-bound, a decode step bandwidth-bound. The engines' decode GEMMs (fp32 ``MatMul``,
4-bit ``MatMulNBits`` with int8 compute) run a 128-token prefill at 160-280 GFLOPS on 2 cores; ONNX Runtime's
``MatMulInteger`` (MLAS's u8s8 GEMM, VNNI where the CPU has it) runs 600-1,900 GOPS on the same shapes. So a
``--prefill int8`` engine carries a second graph for passes of several tokens, every GEMM of the decoder rewritten as

    s = max|x| / 127 per token (row)       q = round(x / s) + 128  (uint8)
    y = (MatMulInteger(q, Wq, 128) as float) * s * ws            Wq [K, N] int8, ws [N]: per-output-channel scales

Per-token activation scales are what keep the accuracy (one scale per tensor, ``DynamicQuantizeMatMul``, costs
SmolLM2 x1.27 perplexity). The MLPs' down projections need more: their input (the gated activation) has outlier
channels (SmolLM2: a channel's max|x| up to 2,900x the median channel's) that one scale per token rounds worst
(SmolLM2, held-out text scored with the prefill graph over the decoder alone, every GEMM in int8 as above: fp32
x1.031, past the bound). So they are smoothed, SmoothQuant's way (Xiao et al. 2023; the same factors as
:mod:`trtinfer.quantization.smoothquant`): ``x W = (x / s) (diag(s) W)`` with ``s_j = max|x_j| ** a / max|W_j| **
(1 - a)``, ``max|x_j|`` measured per channel on the stage's graph over the built-in calibration text (8 windows of 128
tokens, never the held-out text the check scores), ``a`` = :data:`SMOOTH_ALPHA`. ``1/s`` costs nothing: the input is
``act(gate) * up`` and the up projection's output columns take it, in its per-output-channel scales (its int8 codes
are unchanged); where no up projection can take it, one Mul divides the input. Measured, held-out perplexity over the
decoder's (SmolLM2 fp32 / int4, Gemma-3 fp32 / int4): a = 0.6: x1.010 / 1.014 / 1.024 / 1.025; a = 0.5: x1.031 /
1.041 / 1.033 / 1.008; the 99.9th percentile of |x_j| instead of its max, a = 0.5: x1.022 / 1.016 / 1.017 / 1.010;
the down projections kept on the decoder's kernel (this graph before): x1.016 / 0.998 / 1.006 / 1.009, at 1.3-1.4x
the TTFT (docs/benchmarks/cpu.md). A smoothed graph the check refuses is written again with the down projections on
the decoder's kernel (:func:`write_prefill_graph` without a stage), so no model that built before fails now. Also
tried for them before and not kept: K split in 4 groups with a scale each, x1.028 but slower than the decoder's
kernel; a 64- or 512-wide block Hadamard rotation of their input and weight, x1.042 / x1.030; the rounding residual
quantized again as a second int8 GEMM, x1.016 on SmolLM2 int4 but x1.039 fp32 and x1.025 Gemma-3 int4, where the
weights' int8 rounding per output channel is what costs. The LM head's activations (its input is gathered at the positions whose logits are asked:
one row in a prefill) go in twice, as more rows of the same GEMM: their codes and the codes of their rounding
residual, ``x / s - round(x / s)`` at ``s / 254``, added up after it: ~15-bit activations where one more row costs
nothing (the GEMM reads the weight once), and the head's one-pass rounding was the largest single cost in the
check (held-out perplexity over the decoder's: SmolLM2 fp32 x1.026 -> x1.018, int4 x1.014 -> x1.006; Gemma-3 fp32
x1.009 -> x1.008, int4 x1.003 -> x1.001; scoring every position pays a head GEMM of twice the rows). ``Wq`` is the
decoder's own weight (a quantized engine's blocks dequantized; a tied head read through ``FusedMatMul`` transposed)
rounded per output channel, so prefill and decode compute the same model up to int8 rounding. Everything else
(attention, norms, the KV interface) is the decoder's graph unchanged, its weights read from the decoder's data
file: the runtime runs passes of several tokens on this graph and decode steps on the decoder, over the same KV
values. The price is one int8 copy of the rewritten weights beside the decoder's. Measured:
docs/benchmarks/cpu.md.

Not kept: ``MatMulIntegerToFloat`` (the int32 product, its cast and the weight's scales in one kernel, the token's
scale one Mul after it) prefilled SmolLM2 int4 in 82 ms instead of 89 on a Xeon, the same arithmetic up to float
rounding, but each token's int8 rounding makes any reordering of the float products another sample of the int8
noise, and the check moved with it: swapping the two Muls below alone took SmolLM2 fp32 from x1.026 to x1.030 (the
bound; the fused form also x1.030), and with the head's residual codes in place the fused form gave SmolLM2 fp32
x1.024 and Gemma-3 int4 x1.021 against x1.018 and x1.001 unfused.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx_ir as ir

from trtinfer.artifact import StageDir
from trtinfer.builder.config import PREFILL_GEMM_OPS
from trtinfer.quantization.blocks import BlockWeight
from trtinfer.quantization.int8_static import per_channel_int8
from trtinfer.quantization.weights import MS_DOMAIN

log = logging.getLogger(__name__)

PREFILL_NAME = "prefill.onnx"
PREFILL_DATA = "prefill.onnx.data"
#: initializers of at most this many bytes stay in the graph file
_INLINE_BYTES = 1024
#: activation zero point: symmetric int8 codes shifted into MLAS's fastest (u8 x s8) GEMM
_SHIFT = 128
#: the prefill graph's metadata entry: how many down projections it runs smoothed in int8
SMOOTHED_KEY = "trtinfer.smoothed_down_projections"
#: SmoothQuant's migration strength for the down projections (module docstring: measured)
SMOOTH_ALPHA = 0.6
#: windows x tokens of the built-in calibration text the down projections' input statistics are taken over
SMOOTH_WINDOWS, SMOOTH_TOKENS = 8, 128


def _float_weight(node: ir.Node) -> tuple[ir.TensorProtocol, bool] | None:
    """The constant 2-D float32 weight of a plain MatMul, or of a FusedMatMul that only transposes it (ONNX Runtime's
    form of a head reading a tied embedding), and whether it is stored transposed (``[N, K]``); else None."""
    transposed = False
    if node.op_type == "FusedMatMul" and node.domain == MS_DOMAIN and len(node.inputs) == 2:
        a = node.attributes
        if (a.get_int("transA", 0) or a.get_int("transBatchA", 0) or a.get_int("transBatchB", 0)
                or a.get_float("alpha", 1.0) != 1.0):
            return None
        transposed = bool(a.get_int("transB", 0))
    elif node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    t = None if w is None else w.const_value
    if t is None or t.dtype != ir.DataType.FLOAT or len(t.shape) != 2:
        return None
    return t, transposed


def _nbits_weight(node: ir.Node) -> Callable[[], np.ndarray] | None:
    """A reader of a MatMulNBits node's constant weight as float32 ``[K, N]`` (nothing is read until it is called),
    else None."""
    if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN:
        return None
    ins = [*node.inputs, None, None, None, None, None]
    if ins[4] is not None:  # g_idx (act-order): not written by this toolchain
        return None
    b, scales, zps = (None if v is None else v.const_value for v in ins[1:4])
    if b is None or scales is None or (ins[3] is not None and zps is None):
        return None
    attr = node.attributes
    k, n, bits, block = (attr.get_int(a, 0) for a in ("K", "N", "bits", "block_size"))

    def read() -> np.ndarray:
        return BlockWeight.from_matmul_nbits(b.numpy(), scales.numpy(), None if zps is None else zps.numpy(), k, n,
                                             bits, block).dequantize()

    return read


def _gemm_weight(node: ir.Node) -> tuple[int, int, Callable[[], np.ndarray]] | None:
    """``(K, N, reader of the float32 [K, N] weight)`` of a GEMM with a constant weight, else None."""
    if node.op_type == "MatMulNBits":
        read = _nbits_weight(node)
        attr = node.attributes
        return None if read is None else (attr.get_int("K", 0), attr.get_int("N", 0), read)
    got = _float_weight(node)
    if got is None:
        return None
    w, transposed = got
    k, n = (int(d) for d in w.shape.numpy())
    if transposed:
        return n, k, lambda: np.ascontiguousarray(w.numpy().T)
    return k, n, w.numpy


class _Int8Weight:
    """One GEMM weight's int8 codes and scales, computed from its source when first read and dropped once both were
    written (an engine's weights are never all in memory at once)."""

    def __init__(self, read: Callable[[], np.ndarray], k: int, n: int) -> None:
        self._read = read
        self._pair: tuple[np.ndarray, np.ndarray] | None = None
        self._taken = 0
        self.codes = ir.LazyTensor(lambda: ir.Tensor(self._half(0)), dtype=ir.DataType.INT8, shape=ir.Shape([k, n]))
        self.scales = ir.LazyTensor(lambda: ir.Tensor(self._half(1)), dtype=ir.DataType.FLOAT, shape=ir.Shape([n]))

    def _half(self, i: int) -> np.ndarray:
        if self._pair is None:
            self._pair = per_channel_int8(self._read())
        out = self._pair[i]
        self._taken += 1
        if self._taken == 2:  # both written: free them (read again, they are computed again)
            self._pair, self._taken = None, 0
        return out


def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.Tensor(array, name=name))
    value.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    value.shape = ir.Shape(array.shape)
    graph.register_initializer(value)
    return value


def _is_head(x: ir.Value) -> bool:
    """Whether ``x`` feeds the LM head: gathered at the positions whose logits are asked (one row in a prefill)."""
    producer = x.producer()
    return producer is not None and producer.op_type in ("Gather", "GatherND")


def _row_codes(graph: ir.Graph, x: ir.Value, c: dict[str, ir.Value], opset: int,
               residual: bool) -> tuple[list[ir.Node], tuple[ir.Value, ir.Value]]:
    """The nodes quantizing ``x`` per row (token) and ``(uint8 codes, per-row scale)``. With ``residual`` the rows are
    doubled: each row's codes, then the codes of its rounding residual (``x / s - round(x / s)``, in [-1/2, 1/2],
    at scale ``s / 254``), so one GEMM computes both and their halves add up to ~15-bit activations."""
    mag = ir.node("Abs", [x])
    amax = (ir.node("ReduceMax", [mag.outputs[0], c["axes"]], attributes={"keepdims": 1}) if opset >= 18 else
            ir.node("ReduceMax", [mag.outputs[0]], attributes={"keepdims": 1, "axes": [-1]}))
    floor = ir.node("Max", [amax.outputs[0], c["eps"]])
    s = ir.node("Div", [floor.outputs[0], c["div"]])
    scaled = ir.node("Div", [x, s.outputs[0]])
    q = ir.node("QuantizeLinear", [scaled.outputs[0], c["one"], c["zp"]])  # rounds, saturates, shifts
    nodes = [mag, amax, floor, s, scaled, q]
    if not residual:
        return nodes, (q.outputs[0], s.outputs[0])
    if "residual" not in c:
        c["residual"] = _const(graph, "prefill.residual", np.array(254.0, np.float32))
    rounded = ir.node("Round", [scaled.outputs[0]])  # half to even, as QuantizeLinear rounds
    rest = ir.node("Sub", [scaled.outputs[0], rounded.outputs[0]])
    up = ir.node("Mul", [rest.outputs[0], c["residual"]])
    q2 = ir.node("QuantizeLinear", [up.outputs[0], c["one"], c["zp"]])
    s2 = ir.node("Div", [s.outputs[0], c["residual"]])
    codes = ir.node("Concat", [q.outputs[0], q2.outputs[0]], attributes={"axis": -2})
    scales = ir.node("Concat", [s.outputs[0], s2.outputs[0]], attributes={"axis": -2})
    return nodes + [rounded, rest, up, q2, s2, codes, scales], (codes.outputs[0], scales.outputs[0])


def _fold_target(x: ir.Value, rewritten: dict[int, ir.Node]) -> ir.Node | None:
    """The GEMM whose output columns can take a down projection's ``1/s`` for free: ``x`` is ``a * (h @ W_up)``, read
    only by the down projection, ``W_up`` rewritten to int8 (its per-output-channel scales absorb the division), its
    output read only by that Mul and no bias after it; else None (an explicit Mul divides ``x``)."""
    mul = x.producer()
    if mul is None or mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or x.is_graph_output() \
            or len(x.uses()) != 1:
        return None
    for v in mul.inputs:
        up = None if v is None else v.producer()
        if (v is not None and up is not None and id(up) in rewritten and not v.is_graph_output()
                and all(u.node is mul for u in v.uses()) and _bias(up) is None):
            return up
    return None


def _bias(node: ir.Node) -> ir.Value | None:
    return node.inputs[5] if node.op_type == "MatMulNBits" and len(node.inputs) > 5 else None


def _smoothing(gemms: list[tuple[ir.Node, tuple[int, int, Callable[[], np.ndarray]]]], keep_k: int,
               act_amax: Mapping[str, np.ndarray]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], set[int]]:
    """For each down projection whose input has statistics: ``s`` by node (scaling its weight's rows), ``1/s`` by
    the up projection that takes it (scaling its weight's columns), and the down projections so folded."""
    from trtinfer.quantization.smoothquant import smoothing_factors

    rewritten = {id(node): node for node, (k, _n, _r) in gemms
                 if node.inputs[0] is not None and (k != keep_k or node.inputs[0].name in act_amax)}
    rows: dict[int, np.ndarray] = {}
    cols: dict[int, np.ndarray] = {}
    folded: set[int] = set()
    for node, (k, _n, read) in gemms:
        x = node.inputs[0]
        if k != keep_k or x is None or x.name is None or x.name not in act_amax:
            continue
        w = read()
        rows[id(node)] = s = smoothing_factors(act_amax[x.name], np.maximum(w.max(axis=1), -w.min(axis=1)),
                                               SMOOTH_ALPHA)
        del w
        up = _fold_target(x, rewritten)
        if up is not None and id(up) not in cols:
            cols[id(up)] = (np.float32(1.0) / s).astype(np.float32)
            folded.add(id(node))
    return rows, cols, folded


def _scaled(read: Callable[[], np.ndarray], rows: np.ndarray | None, cols: np.ndarray | None
            ) -> Callable[[], np.ndarray]:
    def scaled() -> np.ndarray:
        w = read()
        if rows is not None:
            w = w * rows[:, None]
        if cols is not None:
            w = w * cols[None, :]
        return w

    return scaled


def int8_prefill(model: ir.Model, gemm_ops: tuple[str, ...], act_amax: Mapping[str, np.ndarray] | None = None) -> int:
    """Rewrite ``model`` in place: every ``gemm_ops`` node with a constant weight becomes the int8 form of the module
    docstring (one activation quantization per distinct input). The MLPs' down projections (the GEMMs with the most
    input features: a decoder's intermediate size is larger than its hidden size and its attention width) are
    rewritten smoothed where ``act_amax`` has their input's per-channel ``max|x|``, else they keep the decoder's
    kernel. Returns how many GEMMs were rewritten."""
    graph = model.graph
    gemms = [(node, got) for node in graph if node.op_type in gemm_ops for got in [_gemm_weight(node)] if got]
    keep_k = max((k for _, (k, _n, _r) in gemms), default=0)
    rows, cols, folded = _smoothing(gemms, keep_k, act_amax or {})
    opset = graph.opset_imports.get("", 0)
    c = {"axes": _const(graph, "prefill.axes", np.array([-1], np.int64)),
         "eps": _const(graph, "prefill.eps", np.array(1e-12, np.float32)),
         "div": _const(graph, "prefill.div", np.array(127.0, np.float32)),
         "one": _const(graph, "prefill.one", np.array(1.0, np.float32)),
         "zp": _const(graph, "prefill.zp", np.array(_SHIFT, np.uint8))}
    quantized: dict[int, tuple[ir.Value, ir.Value]] = {}  # id(activation) -> (uint8 codes, per-token scale)
    done = 0
    for node, (k, n, read) in gemms:
        x = node.inputs[0]
        if x is None or (k == keep_k and id(node) not in rows):  # a down projection without statistics: kept
            continue
        tag = f"prefill.{done}"
        twice = _is_head(x)  # the head's codes carry their rounding residual too (module docstring)
        new: list[ir.Node] = []
        if id(node) in rows and id(node) not in folded:  # x / s where no up projection could take it
            div = ir.node("Mul", [x, _const(graph, f"{tag}.smooth", (np.float32(1.0) / rows[id(node)]))])
            new.append(div)
            x = div.outputs[0]
        if id(x) not in quantized:
            codes, quantized[id(x)] = _row_codes(graph, x, c, opset, twice)
            new += codes
        xq, xs = quantized[id(x)]
        w = _Int8Weight(_scaled(read, rows.get(id(node)), cols.get(id(node))), k, n)
        wq = ir.Value(name=f"{tag}.weight", const_value=w.codes)
        ws = ir.Value(name=f"{tag}.scale", const_value=w.scales)
        for v in (wq, ws):
            graph.register_initializer(v)
        mm = ir.node("MatMulInteger", [xq, wq, c["zp"]])
        f = ir.node("Cast", [mm.outputs[0]], attributes={"to": ir.DataType.FLOAT})
        per_token = ir.node("Mul", [f.outputs[0], xs])
        tail = [mm, f, per_token]
        if twice:  # rows [codes; residual codes]: the two halves add up
            split = {"axis": -2, **({"num_outputs": 2} if opset >= 18 else {})}
            halves = ir.node("Split", [per_token.outputs[0]], attributes=split, num_outputs=2)
            tail += [halves, ir.node("Add", list(halves.outputs))]
        y = ir.node("Mul", [tail[-1].outputs[0], ws])
        tail.append(y)
        out = y.outputs[0]
        bias = _bias(node)
        if bias is not None:
            add = ir.node("Add", [out, bias])
            tail.append(add)
            out = add.outputs[0]
        graph.insert_before(node, [*new, *tail])
        old = node.outputs[0]
        name, old.name = old.name, f"{tag}.replaced"
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        out.name = name  # the decoder's value names (the graph's outputs among them) stay
        for i in range(len(node.inputs)):  # its weights lose their one reader: dropped below
            node.replace_input_with(i, None)
        graph.remove(node, safe=False)
        done += 1
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    for name, value in list(graph.initializers.items()):  # the replaced weights: not written to the prefill graph
        if not value.uses() and not value.is_graph_output():
            del graph.initializers[name]
    return done


def down_input_amax(stage: StageDir, model: ir.Model, gemm_ops: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Per-channel ``max|x|`` of the down projections' inputs in ``model`` (an engine's decoder graph), measured on
    ``stage``'s graph (the same model before compilation; the inputs keep their names) over the built-in calibration
    text; an input the stage's graph does not name gets none (its GEMM keeps the decoder's kernel)."""
    from trtinfer.calibration import (
        ChannelRangeCollector,
        StageFeeds,
        collect,
        stage_calibration_set,
        weight_matmul_inputs,
    )

    gemms = [(node, got[0]) for node in model.graph if node.op_type in gemm_ops for got in [_gemm_weight(node)] if got]
    keep_k = max((k for _, k in gemms), default=0)
    known = set(weight_matmul_inputs(stage, gemm_ops))
    names = [x.name for node, k in gemms if k == keep_k for x in [node.inputs[0]] if x is not None and x.name in known]
    if not names:
        return {}
    cset = stage_calibration_set(stage, None, num_samples=SMOOTH_WINDOWS, seq_len=SMOOTH_TOKENS, decode_steps=0)
    ranges = ChannelRangeCollector()
    collect(stage, StageFeeds(stage, cset), names, ranges.update, progress=False)
    return {name: r.amax for name, r in ranges.ranges().items()}


def smoothed_down_projections(engine: Path) -> int:
    """How many down projections the engine's prefill graph runs smoothed in int8 (its metadata; no weight read)."""
    import onnx

    props = {p.key: p.value for p in onnx.load(str(engine / PREFILL_NAME), load_external_data=False).metadata_props}
    return int(props.get(SMOOTHED_KEY, 0))


def write_prefill_graph(engine: Path, decoder: str, precision: str, stage: StageDir | None = None) -> dict[str, str]:
    """Write :data:`PREFILL_NAME` (+ its data file) into ``engine`` from the engine's ``decoder`` graph of
    ``precision``; returns the manifest's file entries. With ``stage`` (the graph the engine was compiled from), the
    down projections are smoothed into int8 too (:func:`down_input_amax`), else they keep the decoder's kernel."""
    model = ir.load(engine / decoder)
    gemm_ops = PREFILL_GEMM_OPS[precision]
    amax = None if stage is None else down_input_amax(stage, model, gemm_ops)
    done = int8_prefill(model, gemm_ops, amax)
    model.metadata_props[SMOOTHED_KEY] = str(len(amax or {}))
    # only the int8 weights are new: what the graph keeps of the decoder's (the embedding table, the down projections,
    # norms) is read from the decoder's own data file in the same folder, not copied (SmolLM2 fp32: 109 MB, was 329)
    fresh = [(v, t) for v in model.graph.initializers.values() for t in [v.const_value]
             if t is not None and not isinstance(t, ir.ExternalTensor) and t.nbytes > _INLINE_BYTES]
    written = ir.external_data.convert_tensors_to_external([t for _, t in fresh], engine, PREFILL_DATA)
    for (value, _), tensor in zip(fresh, written, strict=True):
        value.const_value = tensor
    ir.save(model, engine / PREFILL_NAME)  # external tensors keep their files and offsets
    shared = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                 if isinstance(v.const_value, ir.ExternalTensor) and v.const_value.location != PREFILL_DATA)
    log.debug("prefill graph: %d GEMMs on int8 activations and weights (%d down projections smoothed); %.0f MiB of "
              "weights read from %s", done, len(amax or {}), shared / 2**20, decoder)
    return {"prefill": PREFILL_NAME, "prefill_data": PREFILL_DATA}
