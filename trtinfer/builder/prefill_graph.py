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
(SmolLM2 fp32, held-out text scored with the prefill graph over the decoder alone: x1.031 with them in int8 as the
rest, past the bound). So they are smoothed first, SmoothQuant's way, the strength searched per layer on calibration
rows, the division folded into the up projection's scales (:mod:`~trtinfer.builder.prefill_smoothing`, measurements
there). A graph the check refuses with them in int8 is written again with them on the decoder's kernel
(:func:`write_prefill_graph` without a stage), so no model that built before fails now. Also tried for them before
and not kept: K split in 4 groups with a scale each, x1.028 but slower than the decoder's kernel; a 64- or 512-wide
block Hadamard rotation of their input and weight, x1.042 / x1.030; the rounding residual quantized again as a second
int8 GEMM, x1.016 on SmolLM2 int4 but x1.039 fp32 and x1.025 Gemma-3 int4, where the weights' int8 rounding per
output channel is what costs. The LM head's activations (its input is gathered at the positions whose logits are asked:
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

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx_ir as ir

from trtinfer.artifact import StageDir
from trtinfer.builder.config import PREFILL_GEMM_OPS
from trtinfer.builder.prefill_smoothing import Gemm, InputStats, gemm_bias, input_stats, plan
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
#: the prefill graph's metadata entry: the smoothing strength of each down projection it runs in int8 (JSON list)
ALPHAS_KEY = "trtinfer.down_projection_alphas"


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


def _gemms(model: ir.Model, gemm_ops: tuple[str, ...]) -> tuple[list[Gemm], set[int]]:
    """The GEMMs with a constant weight and an input, and (node ids) the MLPs' down projections among them: those with
    the most input features (a decoder's intermediate size is larger than its hidden size and its attention width)."""
    gemms = [(node, got) for node in model.graph if node.op_type in gemm_ops and node.inputs[0] is not None
             for got in [_gemm_weight(node)] if got]
    widest = max((k for _, (k, _n, _r) in gemms), default=0)
    return gemms, {id(node) for node, (k, _n, _r) in gemms if k == widest}


def int8_prefill(model: ir.Model, gemm_ops: tuple[str, ...],
                 stats: Mapping[str, InputStats] | None = None) -> tuple[int, list[float | None]]:
    """Rewrite ``model`` in place: every ``gemm_ops`` node with a constant weight becomes the int8 form of the module
    docstring (one activation quantization per distinct input). The MLPs' down projections are rewritten smoothed
    (:mod:`~trtinfer.builder.prefill_smoothing`) where ``stats`` has their input, else they keep the decoder's
    kernel. Returns how many GEMMs were rewritten and the smoothing strength of each down projection in int8."""
    graph = model.graph
    stats = stats or {}
    gemms, downs = _gemms(model, gemm_ops)
    gemms = [g for g in gemms if id(g[0]) not in downs or (g[0].inputs[0].name or "") in stats]  # type: ignore[union-attr]
    smoothing = plan(gemms, downs, stats)
    rows, cols, folded = smoothing.rows, smoothing.cols, smoothing.folded
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
        assert x is not None
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
        bias = gemm_bias(node)
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
    return done, smoothing.alphas


def down_projection_alphas(engine: Path) -> list[float | None]:
    """The smoothing strength of each down projection the engine's prefill graph runs in int8 (its metadata; no
    weight read); empty where they keep the decoder's kernel."""
    import onnx

    props = {p.key: p.value for p in onnx.load(str(engine / PREFILL_NAME), load_external_data=False).metadata_props}
    return list(json.loads(props.get(ALPHAS_KEY, "[]")))


def write_prefill_graph(engine: Path, decoder: str, precision: str, stage: StageDir | None = None) -> dict[str, str]:
    """Write :data:`PREFILL_NAME` (+ its data file) into ``engine`` from the engine's ``decoder`` graph of
    ``precision``; returns the manifest's file entries. With ``stage`` (the graph the engine was compiled from), the
    down projections are smoothed into int8 too, their inputs' statistics taken on it
    (:func:`~trtinfer.builder.prefill_smoothing.input_stats`), else they keep the decoder's kernel."""
    from trtinfer.calibration import weight_matmul_inputs

    model = ir.load(engine / decoder)
    gemm_ops = PREFILL_GEMM_OPS[precision]
    stats = None
    if stage is not None:
        gemms, downs = _gemms(model, gemm_ops)
        known = set(weight_matmul_inputs(stage, gemm_ops))
        names = [x.name for node, _ in gemms if id(node) in downs for x in [node.inputs[0]]
                 if x is not None and x.name in known]
        stats = input_stats(stage, names) if names else None
    done, alphas = int8_prefill(model, gemm_ops, stats)
    model.metadata_props[ALPHAS_KEY] = json.dumps(alphas)
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
    log.debug("prefill graph: %d GEMMs on int8 activations and weights (down projections' smoothing: %s); %.0f MiB of "
              "weights read from %s", done, alphas or "kept", shared / 2**20, decoder)
    return {"prefill": PREFILL_NAME, "prefill_data": PREFILL_DATA}
