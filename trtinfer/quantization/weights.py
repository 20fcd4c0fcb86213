"""Weight-only rewrites onto ONNX Runtime's ``com.microsoft`` block-quantized ops.

    x [.., K] --MatMul(W [K,N] fp32)-->  y        becomes   x --MatMulNBits(B, scales; bits, block, level 4)--> y
    ids --Gather(E [V,K] fp32)--> emb          becomes   ids --GatherBlockQuantized(B', scales')--> Reshape --> emb

Each MatMul with a constant 2-D weight is a :class:`WeightSite`; a quantizer (round-to-nearest, GPTQ, an imported
GGUF block) turns its weight into a :class:`~trtinfer.quantization.blocks.BlockWeight` and :func:`replace_matmul`
swaps the node. With tied embeddings the LM head's packed ``B [V, K/block, blob]`` also feeds the embedding's
``GatherBlockQuantized`` (3-D data, quantized along its last axis; a Reshape folds ``[.., K/block, block]`` back to
``[.., K]``): one stored copy serves both, as onnxruntime-genai does.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import onnx_ir as ir

from trtinfer.passes.embedding import const_2d, lm_head_node
from trtinfer.quantization.blocks import BlockWeight, check_layout, quantize_rtn, quantize_rtn_columns, unpack_codes
from trtinfer.quantization.config import LM_HEAD, QuantConfig

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"


@dataclass
class WeightSite:
    """A MatMul reading a constant ``[K, N]`` fp32 weight; ``lm_head`` marks the one producing the logits."""

    node: ir.Node
    weight: ir.Value
    lm_head: bool

    @property
    def name(self) -> str:
        """The node's name (traces back to the HF module, e.g. ``/model/model/layers.3/self_attn/q_proj/MatMul``)."""
        return self.node.name or self.weight.name or "?"

    @property
    def k(self) -> int:
        """Input features."""
        assert self.weight.const_value is not None
        return int(self.weight.const_value.shape.numpy()[0])

    @property
    def n(self) -> int:
        """Output features."""
        assert self.weight.const_value is not None
        return int(self.weight.const_value.shape.numpy()[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the float32 weight (from its shape: nothing is read)."""
        return 4 * self.k * self.n

    def array(self) -> np.ndarray:
        """The weight as float32 ``[K, N]``."""
        assert self.weight.const_value is not None
        return np.asarray(self.weight.const_value.numpy(), dtype=np.float32)

    def columns(self, start: int, stop: int) -> np.ndarray:
        """Columns ``start:stop`` of the weight as float32 ``[K, stop - start]``: a weight still in the checkpoint
        reads only them; any other is mapped (let go with :func:`release` once every column is read)."""
        from trtinfer.stage_weights import CheckpointTensor

        t = self.weight.const_value
        assert t is not None
        if isinstance(t, CheckpointTensor):
            return t.columns(start, stop)
        return np.asarray(np.asarray(t.numpy())[:, start:stop], dtype=np.float32)


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Computes(Protocol[T_co]):
    """A weight whose blocks are made when first read."""

    def compute(self) -> T_co: ...


class BlockCache:
    """The last few weights :class:`LazyBlocks` (or another lazy import) computed: a save writes one weight's B,
    scales and zero points in a row (a packed QKV reads three weights' B, then their scales), so each weight is
    quantized once."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._items: OrderedDict[int, Any] = OrderedDict()

    def get(self, blocks: Computes[T]) -> T:
        q: T | None = self._items.get(id(blocks))
        if q is None:
            q = blocks.compute()
            self._items[id(blocks)] = q
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return q

    def lazy(self, blocks: Computes[T], make: Callable[[T], np.ndarray], dtype: ir.DataType,
             shape: list[int]) -> ir.LazyTensor:
        """A tensor of ``make(blocks' computed value)``, computed (through this cache) when a save reads it."""
        return ir.LazyTensor(lambda: ir.Tensor(np.ascontiguousarray(make(self.get(blocks)))), dtype=dtype,
                             shape=ir.Shape(shape))


class LazyBlocks:
    """Round-to-nearest blocks of one weight, computed when a save first reads its tensors (quantize while writing).

    The weight is ``x @ W`` with ``W [K, N]`` (a MatMul's weight), or with ``transpose`` a table ``E [V, K]`` read as
    ``W = E^T`` (an embedding Gather). Offers :class:`BlockWeight`'s inputs as lazy onnx-ir tensors, so the
    quantized graph holds no packed array in memory until it is written, one weight at a time.
    """

    def __init__(self, weight: ir.TensorProtocol, bits: int, block: int, symmetric: bool, cache: BlockCache,
                 transpose: bool = False) -> None:
        rows, cols = (int(d) for d in weight.shape.numpy())
        self.k, self.n = (cols, rows) if transpose else (rows, cols)
        check_layout(self.k, bits, block)
        self.weight, self.bits, self.block, self.symmetric = weight, bits, block, symmetric
        self.cache, self.transpose = cache, transpose

    def compute(self) -> BlockWeight:
        """The blocks: a weight still in the checkpoint is read a chunk of output columns at a time (never whole),
        any other read whole and its mapped pages let go after."""
        from trtinfer.stage_weights import CheckpointTensor

        t = self.weight
        if isinstance(t, CheckpointTensor):  # W's columns are the table's rows when W = E^T
            cols = (lambda a, b: t.rows(a, b).T) if self.transpose else t.columns
            return quantize_rtn_columns(cols, self.k, self.n, self.bits, self.block, self.symmetric)
        w = np.asarray(t.numpy(), np.float32)
        q = quantize_rtn(w.T if self.transpose else w, self.bits, self.block, self.symmetric)
        del w
        release(t)
        return q

    def packed(self) -> ir.LazyTensor:
        """``MatMulNBits``' B ``[N, K/block, block*bits/8]`` uint8."""
        return self.cache.lazy(self, BlockWeight.packed, ir.DataType.UINT8,
                               [self.n, self.k // self.block, self.block * self.bits // 8])

    def flat_scales(self) -> ir.LazyTensor:
        """``MatMulNBits``' scales ``[N * K/block]``."""
        return self.cache.lazy(self, BlockWeight.flat_scales, ir.DataType.FLOAT, [self.n * (self.k // self.block)])

    def gather_scales(self) -> ir.LazyTensor:
        """``GatherBlockQuantized``'s scales ``[N, K/block, 1]``."""
        return self.cache.lazy(self, BlockWeight.gather_scales, ir.DataType.FLOAT, [self.n, self.k // self.block, 1])

    def packed_zero_points(self) -> ir.LazyTensor | None:
        """``MatMulNBits``' zero points, or None when symmetric."""
        if self.symmetric:
            return None
        per_row = -(-(self.k // self.block) * self.bits // 8)
        return self.cache.lazy(self, lambda q: q.packed_zero_points(),  # type: ignore[arg-type,return-value]
                               ir.DataType.UINT8, [self.n, per_row])


class SpilledBlocks(LazyBlocks):
    """Blocks computed before the stage is written (GPTQ), kept in a file of ``folder`` until then (packed codes,
    scales, zero points), so a model's blocks are never all in memory: the Qwen3-8B shape's held 4.7 GB of packed
    codes and scales beside the calibration (a 9.2 GB build peak)."""

    def __init__(self, q: BlockWeight, folder: Path, cache: BlockCache) -> None:
        fd, name = tempfile.mkstemp(suffix=".npz", dir=folder)
        os.close(fd)
        self.path = Path(name)
        arrays = {"packed": q.packed(), "scales": q.scales}
        if q.zero_points is not None:
            arrays["zero_points"] = q.zero_points
        np.savez(self.path, **arrays)  # type: ignore[arg-type]
        self.k, self.n, self.bits, self.block, self.symmetric = q.k, q.n, q.bits, q.block, q.symmetric
        self.cache, self.transpose = cache, False

    def compute(self) -> BlockWeight:
        """The blocks, read back from the file."""
        with np.load(self.path) as z:
            zp = z["zero_points"] if "zero_points" in z.files else None
            return BlockWeight(unpack_codes(z["packed"], self.bits), z["scales"], zp, self.bits, self.block)


#: what :func:`replace_matmul` and :func:`replace_gather` take: blocks computed now, or when written
Blocks = BlockWeight | LazyBlocks


def release(tensor: ir.TensorProtocol | None) -> None:
    """Unmap an external tensor read from disk (onnx-ir maps on first read and keeps the map: reading every weight
    of a model would keep all of them resident); it maps again if read later."""
    if isinstance(tensor, ir.ExternalTensor):
        try:
            tensor.release()
        except BufferError:  # a view of it is still alive somewhere: it stays mapped, nothing is wrong
            log.debug("%s stays mapped: a view of it is alive", tensor.name)


def weight_sites(graph: ir.Graph, vocab_size: int) -> list[WeightSite]:
    """Every MatMul of ``graph`` with a constant fp32 2-D weight, in graph order."""
    head = lm_head_node(graph, vocab_size)
    return [WeightSite(n, n.inputs[1], n is head)  # type: ignore[arg-type]
            for n in graph if n.op_type == "MatMul" and n.domain == "" and const_2d(n.inputs[1])]


def matches(name: str, patterns: Iterable[str]) -> bool:
    """True if ``name`` matches a glob pattern (``*q_proj*``) or contains a plain pattern as a substring."""
    for p in patterns:
        if any(c in p for c in "*?[") and fnmatch.fnmatchcase(name, p) or p in name:
            return True
    return False


def add_initializer(graph: ir.Graph, name: str, data: np.ndarray | ir.TensorProtocol) -> ir.Value:
    """Register ``data`` (a numpy array or an onnx-ir tensor) as an initializer of ``graph`` named ``name``, or
    ``name_1``, ``name_2``, ... when that name is taken; returns its value (shape and type set)."""
    base, i = name, 1
    while name in graph.initializers:
        name, i = f"{base}_{i}", i + 1
    tensor = ir.Tensor(np.ascontiguousarray(data), name=name) if isinstance(data, np.ndarray) else data
    value = ir.Value(name=name, shape=ir.Shape(list(tensor.shape.numpy())), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def replace_matmul(graph: ir.Graph, site: WeightSite, q: Blocks, accuracy_level: int = 4,
                   packed: ir.Value | None = None) -> tuple[ir.Node, ir.Value]:
    """Swap ``site``'s MatMul for a MatMulNBits computing ``x @ q.dequantize()``; returns the node and its B value.

    ``packed`` reuses an existing B initializer (same codes) instead of storing another copy.
    """
    node = site.node
    base = (site.weight.name or node.name or "w").replace("/", "_").strip("_")
    if packed is None:
        packed = add_initializer(graph, f"{base}_q{q.bits}", q.packed())
    inputs = [node.inputs[0], packed, add_initializer(graph, f"{base}_scales", q.flat_scales())]
    zp = q.packed_zero_points()
    if zp is not None:
        inputs.append(add_initializer(graph, f"{base}_zp", zp))
    new = ir.node("MatMulNBits", inputs, domain=MS_DOMAIN, name=f"{node.name}_Q{q.bits}",
                  attributes={"K": q.k, "N": q.n, "bits": q.bits, "block_size": q.block,
                              "accuracy_level": accuracy_level})
    graph.insert_before(node, new)
    out = node.outputs[0]
    new.outputs[0].name, new.outputs[0].shape, new.outputs[0].type = out.name, out.shape, out.type
    out.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    return new, packed


def replace_gather(graph: ir.Graph, node: ir.Node, q: Blocks, packed: ir.Value | None = None) -> int:
    """Swap the embedding Gather for GatherBlockQuantized on ``q`` (``q`` quantizes ``E^T``, i.e. ``W [K, V]``).

    Returns the bytes newly stored (0 for the table when ``packed``, the LM head's B, is shared).
    """
    if not q.symmetric:
        raise ValueError("GatherBlockQuantized is used with symmetric blocks only")
    table = node.inputs[0]
    assert table is not None
    base = (table.name or "embedding").replace("/", "_")
    stored = 0
    if packed is None:
        packed = add_initializer(graph, f"{base}_q{q.bits}", q.packed())
        stored += packed.const_value.nbytes  # type: ignore[union-attr]
    scales = add_initializer(graph, f"{base}_gather_scales", q.gather_scales())
    stored += scales.const_value.nbytes  # type: ignore[union-attr]
    shape = add_initializer(graph, f"{base}_gather_shape", np.array([0, 0, q.k], dtype=np.int64))
    gbq = ir.node("GatherBlockQuantized", [packed, node.inputs[1], scales], domain=MS_DOMAIN,
                  name=f"{node.name}_Q{q.bits}",
                  attributes={"gather_axis": 0, "quantize_axis": 2, "block_size": q.block, "bits": q.bits})
    out = node.outputs[0]
    reshape = ir.node("Reshape", [gbq.outputs[0], shape], name=f"{node.name}_Q{q.bits}_reshape")
    graph.insert_before(node, [gbq, reshape])
    reshape.outputs[0].name, reshape.outputs[0].shape, reshape.outputs[0].type = out.name, out.shape, out.type
    out.replace_all_uses_with(reshape.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    return stored


def select_sites(sites: Sequence[WeightSite], config: QuantConfig, block: int | None = None,
                 ) -> tuple[list[WeightSite], dict[str, str]]:
    """The sites to quantize under include / keep-fp32 / exclude (``lm_head`` names the LM head), and why the
    others stay fp32; with ``block``, a weight whose ``K`` it does not divide stays fp32 too."""
    chosen, kept = [], {}
    for s in sites:
        names = [s.name, s.weight.name or ""] + ([LM_HEAD] if s.lm_head else [])
        if any(matches(n, config.skip_patterns) for n in names):
            kept[s.name] = "kept in fp32 (--keep-fp32/--exclude)"
        elif config.include and not any(matches(n, config.include) for n in names):
            kept[s.name] = "not in --include"
        elif block is not None and s.k % block:
            kept[s.name] = f"K={s.k} is not a multiple of block {block}"
        else:
            chosen.append(s)
    return chosen, kept
