"""Import a GGUF file's own quantized blocks, exactly, onto ONNX Runtime's ``com.microsoft`` weight-only ops.

The fp32 graph was exported from the GGUF's dequantized weights, and the export recorded which GGUF tensor (name, ggml
type, row order: transformers' rotary order for Llama's q/k) each checkpoint tensor came from
(:mod:`trtinfer.export.gguf_convert`, ``stage.json`` ``weights[*].gguf``). Each MatMul / Gather weight that the graph
reads from the checkpoint is therefore found by name. Re-rounding those values onto a new 4-bit grid doubles the
error (NOTES.md: 1.17-1.48x perplexity); here each GGUF block becomes a symmetric ``MatMulNBits`` block holding the
same integers, so the graph computes what llama.cpp computes.

Every supported type is read as ``w[n, k] = s[n, k/block] * (code[n, k] - 2^(bits-1)) + c[n, k/32]``:

    type   GGUF value            ORT form                         codes         offset c (per 32 values)
    Q8_0   d*q, q in -128..127   8-bit symmetric, block 32        q + 128       -
    Q4_0   d*(q-8)               4-bit symmetric, block 32        q             -
    Q4_1   d*q + m               4-bit symmetric, block 32        q             m + 8d
    Q4_K   d*sc*q - dmin*m       4-bit symmetric, block 32        q             8*d*sc - dmin*m
    Q5_0   d*(q-16)              8-bit symmetric, block 32        q + 112       -
    Q5_1   d*q + m               8-bit symmetric, block 32        q + 112       m + 16d
    Q5_K   d*sc*q - dmin*m       8-bit symmetric, block 32        q + 112       16*d*sc - dmin*m
    Q6_K   d*sc*(q-32)           8-bit symmetric, block 16        q + 96        -

A non-zero offset is the block-sum identity ``x.W = x.(s*(code - z)) + sum_b c_b * (sum_{k in b} x_k)``: exact, no
float zero points (ORT's slow path) and no asymmetric codes (the AVX2 batch-1 bug, ORT #29853)::

    x [.., K] ──MatMulNBits(B, s; level 4)────────────────────────────────► y0 ─┐
      └──Reshape [.., K/32, 32]──ReduceSum(-1)──► xs [.., K/32] ──MatMul(C [K/32, N])──► Add ──► y
                    (one per distinct x: q/k/v share it, gate/up share it)

The token embedding becomes ``GatherBlockQuantized`` on the same codes; with tied embeddings it reads the LM
head's ``B`` through a Reshape, so one copy is stored. A table with offsets adds them back exactly
(``Gather(C^T)`` expanded by a 0/1 matrix). Anything else (F32/F16/BF16 tensors, other GGUF types, weights with no
recorded GGUF origin) stays as it was and is reported.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from trtinfer.checkpoint import GGUF_LINK
from trtinfer.gguf_file import GGUFFile, row_order
from trtinfer.quantization.blocks import BlockWeight
from trtinfer.quantization.weights import MS_DOMAIN, BlockCache, add_initializer
from trtinfer.stage_weights import CheckpointTensor

if TYPE_CHECKING:
    from trtinfer.artifact import StageDir

log = logging.getLogger(__name__)

SUM_BLOCK = 32  # offsets are per 32 values in every type that has them


def _f16(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes per row -> float32 ``[nb, 1]``."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[nb, 16]`` bytes -> ``[nb, 32]`` values: the 16 low nibbles, then the 16 high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 4 bytes (one little-endian uint32) -> bit ``j`` of value ``j``, ``[nb, 32]``."""
    word = np.ascontiguousarray(qh).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """K-quants' 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block, ``[nb, 8]`` each."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


# Each decoder: raw blocks [nb, type_size] uint8 -> codes [nb, elems], scales [nb, elems/block],
# offsets [nb, elems/32] or None. Scales are the float32 products ggml multiplies by (d, d*sc).
Decoded = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def _q8_0(b: np.ndarray) -> Decoded:
    return b[:, 2:] ^ np.uint8(0x80), _f16(b[:, :2]), None  # int8 q -> uint8 q + 128


def _q4_0(b: np.ndarray) -> Decoded:
    return _nibbles(b[:, 2:]), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Decoded:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:]), d, m + 8 * d


def _q5_0(b: np.ndarray) -> Decoded:
    q = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)
    return q + np.uint8(112), _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Decoded:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
    return q + np.uint8(112), d, m + 16 * d


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 128 bytes -> ``[nb, 8, 32]``; each 32-byte group holds sub-block 2g (low) and 2g+1 (high)."""
    g = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (g & 0x0F).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> Decoded:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scale, mins = d * sc, dmin * mn
    return _k_low(b[:, 16:]).reshape(-1, 256), scale, 8 * scale - mins


def _q5_k(b: np.ndarray) -> Decoded:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
    q = _k_low(b[:, 48:]) | ((qh & 1) << 4)
    scale, mins = d * sc, dmin * mn
    return (q + np.uint8(112)).reshape(-1, 256), scale, 16 * scale - mins


def _q6_k(b: np.ndarray) -> Decoded:
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 0x03).reshape(-1, 8, 32) << 4)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return (q + np.uint8(96)).reshape(-1, 256), _f16(b[:, 208:210]) * sc, None


@dataclass(frozen=True)
class BlockType:
    """How one GGUF type maps onto ``MatMulNBits``: its decoder, ORT bits and block, and its super-block size."""

    decode: Callable[[np.ndarray], Decoded]
    bits: int
    block: int
    elems: int  # values per GGUF block (32, or 256 for K-quants)
    offsets: bool = False  # a min term: offsets per 32 values

    @property
    def form(self) -> str:
        """The ORT form in words, for reports."""
        return f"{self.bits}-bit symmetric block {self.block}"


#: Registry of the GGUF types imported exactly, by ``GGMLQuantizationType`` name.
BLOCK_TYPES: dict[str, BlockType] = {
    "Q8_0": BlockType(_q8_0, 8, 32, 32),
    "Q4_0": BlockType(_q4_0, 4, 32, 32),
    "Q4_1": BlockType(_q4_1, 4, 32, 32, offsets=True),
    "Q5_0": BlockType(_q5_0, 8, 32, 32),
    "Q5_1": BlockType(_q5_1, 8, 32, 32, offsets=True),
    "Q4_K": BlockType(_q4_k, 4, 32, 256, offsets=True),
    "Q5_K": BlockType(_q5_k, 8, 32, 256, offsets=True),
    "Q6_K": BlockType(_q6_k, 8, 16, 256),
}


@dataclass
class GGUFBlocks:
    """One GGUF tensor ``[N, K]`` (HF ``Linear`` layout) in symmetric ``MatMulNBits`` form plus 32-value offsets."""

    name: str
    qtype: str
    weight: BlockWeight  # codes [N, K], scales [N, K/block]; stands for x @ W with W [K, N]
    offsets: np.ndarray | None  # [N, K/32] float32

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        return self.weight.n, self.weight.k

    def rows(self) -> np.ndarray:
        """The float32 values ``[N, K]`` these blocks stand for."""
        w = np.ascontiguousarray(self.weight.dequantize().T)
        if self.offsets is not None:
            n, k = w.shape
            w = (w.reshape(n, k // SUM_BLOCK, SUM_BLOCK) + self.offsets[:, :, None]).reshape(n, k)
        return w


def decode_tensor(name: str, qtype: str, raw: np.ndarray, k: int) -> GGUFBlocks:
    """Raw GGUF bytes of a 2-D tensor (``[N, bytes per row]``, ``k`` values per row) -> :class:`GGUFBlocks`."""
    bt = BLOCK_TYPES[qtype]
    n = raw.shape[0]
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * (k // bt.elems), -1)
    codes, scales, offsets = bt.decode(raw)
    weight = BlockWeight(np.ascontiguousarray(codes.reshape(n, k)),
                         np.ascontiguousarray(scales.reshape(n, k // bt.block), dtype=np.float32), None, bt.bits, bt.block)
    off = None if offsets is None else np.ascontiguousarray(offsets.reshape(n, k // SUM_BLOCK), dtype=np.float32)
    return GGUFBlocks(name, qtype, weight, off)


class _Pending:
    """Rows ``perm`` of one GGUF tensor in ORT block form, decoded when a save first reads them (import while
    writing: the graph holds no block of the model until it is written, one weight at a time; decoding every weight
    up front held the Qwen3-8B shape's 8 GB of codes beside its packed copy, a 19 GB build peak)."""

    def __init__(self, file: GGUFFile, name: str, perm: np.ndarray, cache: BlockCache) -> None:
        t = file.tensors[name]
        bt = BLOCK_TYPES[t.qtype]
        self.file, self.name, self.qtype, self.perm, self.cache = file, name, t.qtype, perm, cache
        self.n, self.k, self.bits, self.block, self.has_offsets = len(perm), t.shape[1], bt.bits, bt.block, bt.offsets

    def compute(self) -> GGUFBlocks:
        """Only the rows used, in their order: GGUF blocks run along K, so a row's bytes decode on their own."""
        raw = self.file.raw(self.name)
        return decode_tensor(self.name, self.qtype, raw[self.perm], self.k)

    def packed(self) -> ir.LazyTensor:
        """B ``[N, K/block, block*bits/8]``."""
        return self.cache.lazy(self, lambda b: b.weight.packed(), ir.DataType.UINT8,
                               [self.n, self.k // self.block, self.block * self.bits // 8])

    def scales(self) -> ir.LazyTensor:
        """``[N, K/block]``."""
        return self.cache.lazy(self, lambda b: b.weight.scales, ir.DataType.FLOAT, [self.n, self.k // self.block])

    def offsets(self, transposed: bool) -> ir.LazyTensor:
        """``C [K/32, N]`` (a MatMul's correction) or, not ``transposed``, the table's ``[N, K/32]``."""
        def make(b: GGUFBlocks) -> np.ndarray:
            assert b.offsets is not None
            return b.offsets.T if transposed else b.offsets

        shape = [self.k // SUM_BLOCK, self.n] if transposed else [self.n, self.k // SUM_BLOCK]
        return self.cache.lazy(self, make, ir.DataType.FLOAT, shape)


@dataclass
class _Rewriter:
    graph: ir.Graph
    accuracy_level: int
    report: dict[str, Any]
    packed: dict[tuple[str, str], tuple[_Pending, ir.Value, ir.Value, ir.Value | None]] = field(default_factory=dict)
    sums: dict[tuple[int, int], ir.Value] = field(default_factory=dict)
    count: int = 0
    rank_hint: int | None = None  # rank of every MatMul input when the graph carries no shapes

    def _init(self, name: str, array: np.ndarray | ir.TensorProtocol) -> ir.Value:
        return add_initializer(self.graph, name, array)

    def stored(self, blocks: _Pending) -> tuple[_Pending, ir.Value, ir.Value, ir.Value | None]:
        """B ``[N, K/block, blob]``, scales ``[N, K/block]`` and offsets ``C [K/32, N]`` (or None), stored once per
        tensor and rows (a tied head and embedding share them)."""
        key = (blocks.name, hashlib.sha1(blocks.perm.tobytes()).hexdigest())
        if key not in self.packed:
            c = self._init(f"gguf.{blocks.name}.offsets", blocks.offsets(True)) if blocks.has_offsets else None
            self.packed[key] = (blocks, self._init(f"gguf.{blocks.name}.B", blocks.packed()),
                                self._init(f"gguf.{blocks.name}.scales", blocks.scales()), c)
        return self.packed[key]

    def _node(self, op: str, inputs: list[ir.Value | None], name: str, domain: str = "",
              **attrs: Any) -> ir.Node:
        self.count += 1
        return ir.node(op, inputs, attrs or None, domain=domain, name=f"{name}/{op}_gguf{self.count}")

    def block_sums(self, x: ir.Value, k: int, where: ir.Node, new: list[ir.Node]) -> ir.Value:
        """``xs [.., K/32]``: sums of ``x`` over each 32 values, built once per input."""
        key = (id(x), k)
        if key in self.sums:
            return self.sums[key]
        base = where.name or "gguf"
        rank = len(x.shape) if x.shape is not None else self.rank_hint
        if rank is not None and rank >= 1:
            shape: ir.Value = self._init(f"gguf.sum_shape.{rank}.{k}",
                                         np.array([0] * (rank - 1) + [k // SUM_BLOCK, SUM_BLOCK], np.int64))
        else:
            lead = self._node("Shape", [x], base, end=-1)
            tail = self._init(f"gguf.sum_tail.{k}", np.array([k // SUM_BLOCK, SUM_BLOCK], np.int64))
            cat = self._node("Concat", [lead.outputs[0], tail], base, axis=0)
            new += [lead, cat]
            shape = cat.outputs[0]
        reshape = self._node("Reshape", [x, shape], base)
        axes = self.graph.initializers.get("gguf.axes_last") or self._init("gguf.axes_last", np.array([-1], np.int64))
        total = self._node("ReduceSum", [reshape.outputs[0], axes], base, keepdims=0)
        new += [reshape, total]
        # the sums must exist before every consumer of x that may use them: place them right after x's producer
        self.sums[key] = total.outputs[0]
        return total.outputs[0]

    def matmul(self, node: ir.Node, blocks: _Pending) -> None:
        """``MatMul(x, W)`` -> ``MatMulNBits(x, B, scales)`` (+ block-sum correction)."""
        x = node.inputs[0]
        assert x is not None
        w, b, s, c = self.stored(blocks)
        new: list[ir.Node] = []
        base = node.name or "gguf"
        mm = self._node("MatMulNBits", [x, b, s], base, domain=MS_DOMAIN, K=w.k, N=w.n, bits=w.bits,
                        block_size=w.block, accuracy_level=self.accuracy_level)
        new.append(mm)
        out = mm.outputs[0]
        if c is not None:
            xs = self.block_sums(x, w.k, node, new)
            corr = self._node("MatMul", [xs, c], base)
            add = self._node("Add", [out, corr.outputs[0]], base)
            new += [corr, add]
            out = add.outputs[0]
        ir.convenience.replace_nodes_and_values(self.graph, node, [node], new, [node.outputs[0]], [out])

    def gather(self, node: ir.Node, blocks: _Pending) -> None:
        """``Gather(E, ids)`` -> ``GatherBlockQuantized(reshape(B), ids, scales)`` (+ the offsets, gathered)."""
        ids = node.inputs[1]
        w, b, s, c = self.stored(blocks)
        base = node.name or "gguf"
        data_shape = self._init(f"gguf.{w.name}.gather_shape", np.array([w.n, w.k * w.bits // 8], np.int64))
        data = self._node("Reshape", [b, data_shape], base)
        gbq = self._node("GatherBlockQuantized", [data.outputs[0], ids, s], base, domain=MS_DOMAIN,
                         gather_axis=0, quantize_axis=1, block_size=w.block, bits=w.bits)
        new = [data, gbq]
        out = gbq.outputs[0]
        if c is not None:
            table = self._init(f"gguf.{w.name}.offsets_rows", w.offsets(False))
            spread = self._init(f"gguf.spread.{w.k}", np.kron(np.eye(w.k // SUM_BLOCK, dtype=np.float32),
                                                               np.ones((1, SUM_BLOCK), np.float32)))
            off = self._node("Gather", [table, ids], base, axis=0)
            full = self._node("MatMul", [off.outputs[0], spread], base)  # one 1.0 per output: exact
            add = self._node("Add", [out, full.outputs[0]], base)
            new += [off, full, add]
            out = add.outputs[0]
        ir.convenience.replace_nodes_and_values(self.graph, node, [node], new, [node.outputs[0]], [out])


def _weight_2d(v: ir.Value | None) -> bool:
    """Whether ``v`` is a constant 2-D float weight (an initializer, not a computed value)."""
    if v is None or v.const_value is None or v.producer() is not None:
        return False
    return v.const_value.dtype == ir.DataType.FLOAT and len(v.const_value.shape) == 2


def _nbytes(v: ir.Value) -> int:
    assert v.const_value is not None
    return 4 * int(np.prod(v.const_value.shape.numpy(), dtype=np.int64))  # from the shape: nothing is read


def _origin(weight: ir.Value, is_gather: bool, origins: Mapping[str, Mapping[str, Any]]) -> \
        tuple[Mapping[str, Any], int | None] | str:
    """The GGUF origin of ``weight`` and its rows used (a cut vocabulary), or why it has none.

    A Gather reads its table as the checkpoint stores it; a MatMul reads a Linear weight transposed.
    """
    value = weight.const_value
    if not isinstance(value, CheckpointTensor):
        return "not read from the checkpoint as stored (computed at export)"
    if value.transpose == is_gather:
        return f"reads {value.tensor} {'transposed' if is_gather else 'as stored'}, not as a GGUF tensor's rows"
    origin = origins.get(value.tensor)
    if origin is None:
        return f"no GGUF tensor recorded for {value.tensor}"
    if origin.get("rows") is None:
        return f"{value.tensor} is not a row reordering of GGUF tensor {origin['gguf']}"
    return origin, value.rows_used


def import_gguf(model: ir.Model, gguf_path: str | Path, origins: Mapping[str, Mapping[str, Any]], *,
                accuracy_level: int = 4, exclude: Callable[[str], bool] | None = None,
                rank_hint: int | None = None) -> dict[str, Any]:
    """Rewrite, in place, every MatMul/Gather whose weight came from a GGUF tensor onto that tensor's own blocks.

    ``origins``: checkpoint tensor name -> ``{"gguf": name, "type": ggml type, "rows": row order}``, as the export
    recorded them (:func:`stage_origins`). A weight is found by the checkpoint tensor it reads (a
    :class:`~trtinfer.stage_weights.CheckpointTensor`): ``MatMul(x, W [K, N])`` reading a Linear's ``W.T``
    becomes ``MatMulNBits`` (plus the block-sum correction for types with mins); ``Gather(E, ids)`` becomes
    ``GatherBlockQuantized``, sharing the LM head's stored codes when the two are tied. ``exclude(node name)``
    keeps a node as it is. ``rank_hint``: the rank of MatMul inputs where the graph carries no shapes (3 for
    trtinfer decoders), so block sums reshape by a constant instead of a shape subgraph. Returns a report: counts
    per GGUF type and ORT form, what stayed float and why, and the weight bytes before and after.
    """
    graph = model.graph
    sites: list[tuple[ir.Node, ir.Value, bool]] = []  # (node, weight, is_gather)
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "MatMul" and _weight_2d(node.inputs[1]):
            sites.append((node, node.inputs[1], False))  # type: ignore[arg-type]
        elif (node.op_type == "Gather" and _weight_2d(node.inputs[0])
              and (node.attributes.get_int("axis", 0) or 0) == 0):
            sites.append((node, node.inputs[0], True))  # type: ignore[arg-type]
    report: dict[str, Any] = {"gguf_types": {}, "imported": {}, "kept_float": {}, "excluded": [],
                              "bytes_before": 0, "bytes_after": 0, "shared_embedding": False}
    if not sites:
        return report

    file = GGUFFile(gguf_path)
    for tensor in file.tensors.values():
        if len(tensor.shape) == 2:
            report["gguf_types"][tensor.qtype] = report["gguf_types"].get(tensor.qtype, 0) + 1
    cache = BlockCache()
    rw = _Rewriter(graph, accuracy_level, report, rank_hint=rank_hint)
    weights_before: dict[int, ir.Value] = {}
    for node, weight, is_gather in sites:
        name = node.name or weight.name or "?"
        if exclude is not None and exclude(name):
            report["excluded"].append(name)
            continue
        found = _origin(weight, is_gather, origins)
        if isinstance(found, str):
            report["kept_float"][name] = found
            continue
        origin, rows_used = found
        t = file.tensors.get(str(origin["gguf"]))
        if t is None:
            report["kept_float"][name] = f"{origin['gguf']} is not in {Path(gguf_path).name}"
            continue
        if t.qtype not in BLOCK_TYPES or len(t.shape) != 2 or t.shape[1] % BLOCK_TYPES[t.qtype].elems:
            report["kept_float"][name] = f"{t.name} is {t.qtype} in the GGUF (no exact ORT block form)"
            continue
        order = row_order(origin["rows"], t.shape[0])
        perm = np.arange(t.shape[0]) if order is None else order
        blocks = _Pending(file, t.name, perm[:rows_used] if rows_used else perm, cache)
        weights_before[id(weight)] = weight
        form = BLOCK_TYPES[t.qtype].form + (" + block-sum offsets" if blocks.has_offsets else "")
        op = "GatherBlockQuantized" if is_gather else "MatMulNBits"
        report["imported"].setdefault(f"{t.qtype} -> {op} {form}", []).append(name)
        if is_gather:
            rw.gather(node, blocks)
        else:
            rw.matmul(node, blocks)

    report["bytes_before"] = sum(_nbytes(w) for w in weights_before.values())
    for w in weights_before.values():
        if not w.uses() and not w.is_graph_output() and w.name is not None and w.name in graph.initializers:
            del graph.initializers[w.name]
    after = {id(v): v for _, *trio in rw.packed.values() for v in trio if v is not None}
    report["bytes_after"] = sum(int(v.const_value.nbytes)  # type: ignore[union-attr,misc]
                                for v in after.values())
    gathers = [n for n in graph if n.op_type == "GatherBlockQuantized"]
    heads = {id(n.inputs[1]) for n in graph if n.op_type == "MatMulNBits"}
    report["shared_embedding"] = any(id(g.inputs[0].producer().inputs[0]) in heads  # type: ignore[union-attr]
                                     for g in gathers if g.inputs[0] is not None and g.inputs[0].producer())
    if any(n.domain == MS_DOMAIN for n in graph):
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    graph.sort()
    report["counts"] = {k: len(v) for k, v in report["imported"].items()}
    log.info("gguf import: %d weights imported, %d kept float; %.1f MB -> %.1f MB",
             sum(report["counts"].values()), len(report["kept_float"]),
             report["bytes_before"] / 1e6, report["bytes_after"] / 1e6)
    return report


def stage_origins(stage: StageDir) -> dict[str, dict[str, Any]]:
    """Checkpoint tensor -> GGUF origin, from the export's record in ``stage.json`` (``weights[*].gguf``)."""
    return {str(w["tensor"]): w["gguf"] for w in stage.info.get("weights", {}).values()
            if isinstance(w, dict) and w.get("gguf")}


def gguf_source(stage: StageDir) -> Path | None:
    """The GGUF file ``stage`` was exported from (alias or ``.gguf`` path), if it is still there unchanged."""
    from trtinfer._cache import sha256_file
    from trtinfer.errors import ModelSourceError
    from trtinfer.export.sources import ALIASES

    source = stage.info.get("source") or {}
    alias, kind = source.get("model"), source.get("kind")
    linked = Path(str(source.get("path", ""))) / GGUF_LINK  # a large GGUF's folder links to it (export.gguf_convert)
    try:
        if source.get("path") and linked.is_file():
            path = linked
        elif kind == "alias" and alias in ALIASES:
            path = ALIASES[alias]()
        elif kind == "gguf" and alias:
            path = Path(str(alias)).expanduser()  # the MODEL argument; "path" is the dequantized folder
        else:
            return None
    except ModelSourceError as e:
        log.warning("the GGUF behind %s is not available: %s", stage.path, e)
        return None
    if not path.is_file():
        log.warning("%s was exported from %s, which is gone", stage.path, path)
        return None
    digest = sha256_file(path)
    if source.get("sha256") and digest != source["sha256"]:
        log.warning("%s was exported from a GGUF with sha256 %s but %s now has %s; not importing its blocks",
                    stage.path, str(source["sha256"])[:12], path, digest[:12])
        return None
    return path
