"""Block quantization of weight matrices into the layouts of ONNX Runtime's ``com.microsoft`` weight-only ops.

One :class:`BlockWeight` describes a quantized matrix the way ``MatMulNBits`` stores it: for ``x @ W`` with
``W [K, N]``, column ``n`` is cut along ``K`` into blocks of ``block`` values; each block has one scale (and, when
asymmetric, one integer zero point). Codes are unsigned ``0 .. 2^bits - 1``; a symmetric block has the implicit
zero point ``2^(bits-1)``, so ``w = scale * (code - 2^(bits-1))``.

The same packed rows serve ``GatherBlockQuantized`` for a tied embedding: ``W = E^T`` with ``E [V, K]``, so
``MatMulNBits``' ``[N=V, K/block, blob]`` array *is* ``E`` quantized along its hidden axis (reshaped to
``[V, K*bits/8]``).

    MatMulNBits inputs: A [.., K] float, B [N, K/block, block*bits/8] uint8, scales [N * K/block] float,
                        zero_points [N, ceil(K/block * bits/8)] uint8 (optional)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from trtinfer.errors import ConfigError

BITS = (4, 8)


@dataclass
class BlockWeight:
    """A ``[K, N]`` weight quantized in blocks along ``K``: codes ``[N, K]`` uint8, scales/zero points ``[N, K/block]``."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int
    block: int

    @property
    def k(self) -> int:
        """Input features (rows of ``W``)."""
        return int(self.codes.shape[1])

    @property
    def n(self) -> int:
        """Output features (columns of ``W``)."""
        return int(self.codes.shape[0])

    @property
    def symmetric(self) -> bool:
        """True when every block's zero point is the implicit ``2^(bits-1)``."""
        return self.zero_points is None

    def dequantize(self) -> np.ndarray:
        """The float32 ``[K, N]`` matrix these codes stand for."""
        n, k = self.codes.shape
        nb = k // self.block
        zp = (np.full((n, nb), 1 << (self.bits - 1), np.float32) if self.zero_points is None
              else self.zero_points.astype(np.float32))
        q = self.codes.reshape(n, nb, self.block).astype(np.float32) - zp[:, :, None]
        return np.ascontiguousarray((q * self.scales[:, :, None]).reshape(n, k).T)

    def packed(self) -> np.ndarray:
        """``MatMulNBits``' B input: ``[N, K/block, block*bits/8]`` uint8."""
        return pack_codes(self.codes, self.bits, self.block)

    def flat_scales(self) -> np.ndarray:
        """``MatMulNBits``' scales input ``[N * K/block]``."""
        return self.scales.reshape(-1)

    def gather_scales(self) -> np.ndarray:
        """``GatherBlockQuantized``'s scales ``[N, K/block, 1]`` (rows of the table ``W^T``)."""
        return self.scales[:, :, None]

    @classmethod
    def from_matmul_nbits(cls, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                          bits: int, block: int) -> BlockWeight:
        """The blocks ``MatMulNBits``' inputs ``b``, ``scales`` and ``zero_points`` hold (the inverse of
        :meth:`packed`, :meth:`flat_scales` and :meth:`packed_zero_points`)."""
        codes = unpack_codes(b.reshape(n, -1, b.shape[-1]), bits)[:, :k]
        s = scales.astype(np.float32).reshape(n, -1)
        zp = None if zero_points is None else unpack_codes(zero_points.reshape(n, 1, -1), bits)[:, : s.shape[1]]
        return cls(codes, s, zp, bits, block)

    def packed_zero_points(self) -> np.ndarray | None:
        """``MatMulNBits``' zero_points input ``[N, ceil(K/block * bits/8)]`` uint8, or None when symmetric."""
        if self.zero_points is None:
            return None
        if self.bits == 8:
            return self.zero_points.astype(np.uint8)
        zp = self.zero_points.astype(np.uint8)
        if zp.shape[1] % 2:
            zp = np.concatenate([zp, np.zeros((zp.shape[0], 1), np.uint8)], axis=1)
        return (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)


def check_layout(k: int, bits: int, block: int) -> None:
    """Raise ConfigError unless ``bits``/``block`` are a MatMulNBits layout that divides ``K`` exactly."""
    if bits not in BITS:
        raise ConfigError(f"weight bits must be one of {BITS}, got {bits}")
    if block < 16 or block & (block - 1):
        raise ConfigError(f"block size must be a power of 2 >= 16, got {block}")
    if k % block:
        raise ConfigError(f"block size {block} does not divide the weight's {k} input features")


def pack_codes(codes: np.ndarray, bits: int, block: int) -> np.ndarray:
    """Codes ``[N, K]`` (values < 2^bits) -> ``[N, K/block, block*bits/8]`` uint8, low nibble first for 4 bits."""
    n, k = codes.shape
    c = codes.astype(np.uint8).reshape(n, k // block, block)
    if bits == 8:
        return np.ascontiguousarray(c)
    return np.ascontiguousarray(c[:, :, 0::2] | (c[:, :, 1::2] << 4))


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`pack_codes`: ``[N, K/block, blob]`` -> codes ``[N, K]``."""
    n = packed.shape[0]
    if bits == 8:
        return packed.reshape(n, -1)
    lo, hi = packed & 0x0F, packed >> 4
    return np.stack([lo, hi], axis=-1).reshape(n, -1)


def rtn_params(lo: np.ndarray, hi: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Round-to-nearest float32 scales (and float32 zero points, else None) of blocks whose minima and maxima are
    ``lo`` and ``hi``.

    Symmetric: the value of largest magnitude maps onto ``-2^(bits-1)`` (the grid's wide end); using the signed
    extreme (as ONNX Runtime's own quantizer does) spends the grid's extra negative code on the block's largest value
    instead of wasting it. With a zero point: the block's range, widened to hold 0, spans the grid.
    """
    if symmetric:
        extreme = np.where(np.abs(hi) > np.abs(lo), hi, lo)
        return (extreme / -float(1 << (bits - 1))).astype(np.float32), None
    qmax = (1 << bits) - 1
    lo = np.minimum(lo, 0.0)
    hi = np.maximum(hi, 0.0)
    scales = ((hi - lo) / qmax).astype(np.float32)
    safe = np.where(scales == 0, 1.0, scales)
    return scales, np.clip(np.rint(-lo / safe), 0, qmax).astype(np.float32)


#: output columns quantized at a time: the float temporaries stay ~64 MB whatever the weight (an LM head of a 128k
#: vocabulary quantized whole took 6 GB of them)
RTN_CHUNK_ELEMENTS = 1 << 24


def quantize_rtn(w: np.ndarray, bits: int = 4, block: int = 32, symmetric: bool = True) -> BlockWeight:
    """Round-to-nearest block quantization of ``w [K, N]`` (float) along ``K``, a chunk of output columns at a time."""
    k, n = w.shape
    return quantize_rtn_columns(lambda a, b: w[:, a:b], k, n, bits, block, symmetric)


def quantize_rtn_columns(columns: Callable[[int, int], np.ndarray], k: int, n: int, bits: int = 4, block: int = 32,
                         symmetric: bool = True) -> BlockWeight:
    """:func:`quantize_rtn` of a ``[K, N]`` weight read ``columns(start, stop)`` at a time (a weight streamed from a
    checkpoint is never whole in memory)."""
    check_layout(k, bits, block)
    step = max(1, RTN_CHUNK_ELEMENTS // k)
    return joined([_rtn_columns(columns(j, min(n, j + step)), bits, block, symmetric) for j in range(0, n, step)])


def joined(parts: list[BlockWeight]) -> BlockWeight:
    """One :class:`BlockWeight` of ``parts`` quantized a chunk of output columns at a time, in column order."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    zps = [p.zero_points for p in parts]
    return BlockWeight(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                       None if first.zero_points is None else np.concatenate(zps),  # type: ignore[arg-type]
                       first.bits, first.block)


def _rtn_columns(w: np.ndarray, bits: int, block: int, symmetric: bool) -> BlockWeight:
    k, n = w.shape
    qmax = (1 << bits) - 1
    wb = np.ascontiguousarray(w.T, dtype=np.float32).reshape(n, k // block, block)
    scales, zp = rtn_params(wb.min(axis=-1), wb.max(axis=-1), bits, symmetric)
    safe = np.where(scales == 0, 1.0, scales)[:, :, None]
    offset = (1 << (bits - 1)) if zp is None else zp[:, :, None]
    codes = np.clip(np.rint(wb / safe) + offset, 0, qmax)
    return BlockWeight(codes.reshape(n, k).astype(np.uint8), scales, None if zp is None else zp.astype(np.uint8),
                       bits, block)
