"""GPTQ: block quantization of ``W [K, N]`` that feeds each column's rounding error forward onto the columns not yet
quantized, weighted by the input activations' second moments (Frantar et al. 2022, "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers").

It minimises the layer's output error ``||X W - X Q||^2 = tr((W - Q)^T (X^T X) (W - Q))`` one input feature (a row
of ``W``, a column in the paper's ``[out, in]`` orientation) at a time, in the order of ``K``:

    H    = 2 X^T X / rows + λ·I,   λ = percdamp · mean(diag H)
    U    = upper Cholesky factor of H^-1                      (H^-1 = U^T U)
    for k in 0..K-1:                                          (quantization groups = MatMulNBits blocks along K)
        if k starts a block: scale (and zero point) from the error-updated rows of that block
        q_k  = quantize(w_k);   e_k = (w_k - q_k) / U[k, k]
        w_j -= U[k, j] · e_k    for every j > k

The updates are lazy, as in the reference: rank-1 updates touch only the current block, a GEMM carries a finished
block's errors to the rest of its 128-row batch, and another carries a finished batch's errors to the rows after it.
The output is a :class:`~trtinfer.quantization.blocks.BlockWeight` in MatMulNBits' layout, so it packs the same way as
round-to-nearest.

``act_order`` quantizes rows in order of decreasing ``diag H`` with "static groups": every block's scale is fixed up
front from the original weights, so each block stays the contiguous run of ``K`` that MatMulNBits expects.
``scale_search`` shrinks each block's scale by the factor (of :data:`SCALE_FACTORS`) that minimises the block's
error weighted by ``diag H`` (an MSE-optimal clip).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtinfer.quantization.blocks import BlockWeight, check_layout, joined, rtn_params

logger = logging.getLogger(__name__)

#: Rows per lazy batch (the reference's ``blocksize``); raised to a multiple of the block when a block is larger.
LAZY_BATCH = 128

#: Output columns quantized at a time (x K): the weight's float copies stay ~100 MB each.
GPTQ_CHUNK_ELEMENTS = 1 << 25

#: Candidate shrink factors of a block's scale tried by ``scale_search``.
SCALE_FACTORS = tuple(1.0 - 0.05 * i for i in range(10))


class HessianAccumulator:
    """Sums ``X^T X`` over calibration activations of one MatMul's input, with the row count.

    In float32, as the GPTQ reference keeps ``H`` (float64 doubled the memory of every statistic: 9.7 GB at the
    Llama-3.2-1B shape, whose 16 down-projection inputs alone take a 8192 x 8192 matrix each). Rows are buffered
    and added :data:`FLUSH_ROWS` at a time: a decode step's single row would otherwise cost a pass over the whole
    ``K x K`` matrix. Each addition is one BLAS rank-k update (``ssyrk``) into the sum's lower triangle, in place:
    ``xtx += x.T @ x`` made and added a ``K x K`` temporary per flush, 5-7x slower (2,176 rows in 256-row flushes:
    K = 2048 249 -> 44 ms, K = 4096 1257 -> 167 ms) and 604 MB more at K = 12288. :meth:`hessian` mirrors the
    triangle.
    """

    #: rows gathered before they are added to the sum in one product
    FLUSH_ROWS = 256

    def __init__(self, k: int) -> None:
        self.k = k
        self.xtx = np.zeros((k, k), np.float32)
        self.rows = 0
        self.spent = False  # hessian() turned the sum into the Hessian
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0

    def add(self, x: np.ndarray) -> None:
        """Add activations ``x [..., K]`` (every leading index is one row of ``X``)."""
        if x.shape[-1] != self.k:
            raise ValueError(f"activations must end in {self.k} features, got shape {x.shape}")
        if self.spent:
            raise ValueError("hessian() was already called: the accumulator became it")
        x2 = np.array(x, np.float32).reshape(-1, self.k)  # a copy: the caller's buffer may be reused
        self._pending.append(x2)
        self._pending_rows += x2.shape[0]
        self.rows += x2.shape[0]
        if self._pending_rows >= self.FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            from scipy.linalg import blas

            x = np.concatenate(self._pending)
            # Fortran views of the C-ordered buffers: x.T is [K, rows], its A @ A.T lands in xtx.T's upper triangle,
            # in place (the result is taken back all the same: were the view ever copied, the sum would not be lost)
            self.xtx = blas.ssyrk(1.0, x.T, beta=1.0, c=self.xtx.T, trans=0, lower=0, overwrite_c=1).T
            self._pending, self._pending_rows = [], 0

    def hessian(self) -> np.ndarray:
        """``H = 2 X^T X / rows`` ``[K, K]`` float32 (the Hessian of the mean squared output error), computed in
        place: the accumulator is spent, its sum becomes the Hessian (one ``K x K`` matrix, not two)."""
        if self.spent:
            raise ValueError("hessian() was already called: the accumulator became it")
        if self.rows == 0:
            raise ValueError("no activations were added; call add() before hessian()")
        self._flush()
        h = self.xtx
        for i in range(self.k - 1):  # the lower triangle holds the sum: mirror it, a row at a time (no K x K copy)
            h[i, i + 1:] = h[i + 1:, i]
        h *= np.float32(2.0 / self.rows)
        self.spent = True
        return h


def weighted_error(w: np.ndarray, q: BlockWeight, hessian: np.ndarray) -> float:
    """Relative proxy loss ``tr((W-Q)^T H (W-Q)) / tr(W^T H W)``: with ``H ∝ X^T X``, ``||X(W-Q)||² / ||XW||²``."""
    w32 = np.asarray(w, np.float32)
    e = w32 - q.dequantize()
    h = np.asarray(hessian, np.float32)
    num = float(np.einsum("kn,kn->", h @ e, e, dtype=np.float64))
    den = float(np.einsum("kn,kn->", h @ w32, w32, dtype=np.float64))
    return num / den if den > 0 else num


@dataclass(frozen=True)
class Factor:
    """What GPTQ needs of one Hessian, made once for every weight that reads the same input (q/k/v, gate/up).

    ``u``: upper ``U [K, K]`` float32 with ``U^T U = (H' + λ·I)^-1`` in the visiting order ``perm``, where ``H'`` is
    ``H`` with its dead features (``diag H == 0``) cut loose; ``diag``: ``diag H'`` in the original order (the
    scale search's row weights).
    """

    u: np.ndarray
    perm: np.ndarray
    diag: np.ndarray
    act_order: bool


def factor(hessian: np.ndarray, *, percdamp: float = 0.01, act_order: bool = False) -> Factor:
    """:class:`Factor` of ``hessian`` (:meth:`HessianAccumulator.hessian`; only its shape up to a factor matters).

    Float32, as the reference keeps ``H``, and at most two ``K x K`` matrices at a time (``hessian`` and one working
    matrix that becomes ``U``: LAPACK factors and inverts it in place), so the 17408-wide down-projection Hessians of
    the Qwen3-14B shape take 2.4 GB, not the 7 GB of float64 copies.
    """
    k = hessian.shape[0]
    if hessian.shape != (k, k):
        raise ValueError(f"a Hessian must be square, got {hessian.shape}")
    if not 0.0 <= percdamp < 1.0:
        raise ValueError(f"percdamp must be in [0, 1), got {percdamp}")
    diag = np.diag(hessian).astype(np.float32)
    dead = diag <= 0
    live_mean = float(diag[~dead].mean()) if (~dead).any() else 1.0
    diag[dead] = live_mean
    perm = np.argsort(-diag, kind="stable") if act_order else np.arange(k)
    # J P^T H P J in one copy (J: the order reversal), whose lower Cholesky factor M gives U = J M^-1 J
    order = perm[::-1]
    work = np.asarray(hessian, np.float32)[np.ix_(order, order)]
    flipped_dead = dead[order]
    work[flipped_dead, :] = 0.0
    work[:, flipped_dead] = 0.0
    work[np.flatnonzero(flipped_dead), np.flatnonzero(flipped_dead)] = live_mean
    _lower_cholesky_inverse(work, percdamp * live_mean)
    _reverse_in_place(work)
    return Factor(work, perm, diag, act_order)


def gptq_quantize(w: np.ndarray, hessian: np.ndarray | Factor, *, bits: int = 4, block: int = 32,
                  symmetric: bool = True, percdamp: float = 0.01, act_order: bool = False,
                  scale_search: bool = False) -> BlockWeight:
    """Quantize ``w [K, N]`` (for ``x @ w``) in blocks of ``block`` along ``K`` with GPTQ, given ``H [K, K]`` or its
    :class:`Factor` (made with the same ``act_order``; ``percdamp`` is then the factor's).

    ``hessian`` is :meth:`HessianAccumulator.hessian` of the MatMul's input (only its shape up to a factor matters);
    ``percdamp`` adds ``percdamp · mean(diag H)`` to its diagonal. ``act_order`` visits rows by decreasing
    ``diag H`` with every block's scale fixed up front (static groups, so blocks stay contiguous runs of ``K``);
    ``scale_search`` picks each block's scale among :data:`SCALE_FACTORS` times the round-to-nearest one. Both
    lowered SmolLM2-135M's and Gemma-3-270M's perplexity (``benchmarks/gptq_probe.py``).

    Dead input features (``diag H == 0``: never active in calibration) keep their weights and are rounded plainly;
    their errors do not propagate (the reference zeroes them instead, which would break inputs calibration missed).
    """
    k, n = w.shape
    check_layout(k, bits, block)
    shape = hessian.u.shape if isinstance(hessian, Factor) else hessian.shape
    if shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a weight of shape {w.shape}, got {shape}")
    f = hessian if isinstance(hessian, Factor) else factor(hessian, percdamp=percdamp, act_order=act_order)
    if f.act_order != act_order:
        raise ValueError(f"the factor was made with act_order={f.act_order}, the call asks for {act_order}")
    qmax = (1 << bits) - 1
    mid = 1 << (bits - 1)
    diag_w, perm, u32 = f.diag, f.perm, f.u

    wq = np.array(w, np.float32)  # rows are updated in place, then overwritten by their quantized values
    nb = k // block
    scales = np.zeros((n, nb), np.float32)
    zeros = None if symmetric else np.zeros((n, nb), np.float32)
    codes = np.zeros((k, n), np.uint8)

    def block_params(rows: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Scale (and zero point) per column of one block's rows ``[block, N]`` (reduced along the rows as stored:
        their ``[N, block]`` view is strided)."""
        s, z = rtn_params(rows.min(axis=0), rows.max(axis=0), bits, symmetric)
        if scale_search:
            s, z = _search(rows, weights, s, z, bits, symmetric)
        return s, z

    if act_order:
        for g in range(nb):
            s, z = block_params(wq[g * block:(g + 1) * block], diag_w[g * block:(g + 1) * block])
            scales[:, g] = s
            if zeros is not None and z is not None:
                zeros[:, g] = z
        wq = wq[perm]

    safe_scales = np.where(scales == 0, 1.0, scales).T.astype(np.float32)  # act_order: every block known up front
    safe_block = safe_scales[0]
    batch = max(LAZY_BATCH, block)
    chunk = block if not act_order else min(block, 32)
    err = np.zeros((batch, n), np.float32)
    for i1 in range(0, k, batch):
        i2 = min(i1 + batch, k)
        for j1 in range(i1, i2, chunk):
            j2 = min(j1 + chunk, i2)
            if not act_order:  # j1 starts block j1 // block; its rows carry every earlier row's error by now
                s, z = block_params(wq[j1:j2], diag_w[j1:j2])
                scales[:, j1 // block] = s
                if zeros is not None and z is not None:
                    zeros[:, j1 // block] = z
                safe_block = np.where(s == 0, 1.0, s).astype(np.float32)
            for j in range(j1, j2):
                g = int(perm[j]) // block
                s = scales[:, g]
                safe = safe_scales[g] if act_order else safe_block
                zp = mid if zeros is None else zeros[:, g]
                c = np.clip(np.rint(wq[j] / safe) + zp, 0, qmax)
                q = (c - zp) * s
                e = (wq[j] - q) / u32[j, j]
                codes[j] = c.astype(np.uint8)
                wq[j] = q
                err[j - i1] = e
                if j + 1 < j2:
                    wq[j + 1:j2] -= np.outer(u32[j, j + 1:j2], e)
            if j2 < i2:
                wq[j2:i2] -= u32[j1:j2, j2:i2].T @ err[j1 - i1:j2 - i1]
        if i2 < k:
            wq[i2:] -= u32[i1:i2, i2:].T @ err[:i2 - i1]

    if act_order:
        inv = np.empty_like(perm)
        inv[perm] = np.arange(k)
        codes = codes[inv]
    zp_out = None if zeros is None else zeros.astype(np.uint8)
    return BlockWeight(np.ascontiguousarray(codes.T), scales, zp_out, bits, block)


def gptq_columns(columns: Callable[[int, int], np.ndarray], k: int, n: int, hessian: Factor, **kw: Any) -> BlockWeight:
    """:func:`gptq_quantize` of a ``[K, N]`` weight read ``columns(start, stop)`` at a time (GPTQ treats each output
    column alone): the float temporaries stay ~100 MB whatever the weight (the Qwen3-14B shape's LM head, 151936
    columns, would take 9 GB of them whole)."""
    step = max(1, GPTQ_CHUNK_ELEMENTS // k)
    return joined([gptq_quantize(columns(j, min(n, j + step)), hessian, **kw) for j in range(0, n, step)])


def _lower_cholesky_inverse(a: np.ndarray, damp: float) -> None:
    """Overwrite ``a`` (C-ordered float32, symmetric) with ``M^-1``, ``M`` the lower Cholesky factor of ``a + damp·I``
    (zeros above the diagonal); the damping doubles until the matrix is positive definite.

    LAPACK works in place on the Fortran view ``a.T`` (the same buffer): its upper factor there is ``M`` here.
    """
    from scipy.linalg import lapack

    k = a.shape[0]
    diagonal = np.diag(a).copy()
    damp = max(damp, 1e-8 * float(np.mean(np.abs(diagonal))) or 1e-8)
    for _ in range(20):
        a.flat[::k + 1] = diagonal + damp
        _, info = lapack.spotrf(a.T, lower=0, clean=0, overwrite_a=1)
        if info == 0:
            break
        logger.debug("Hessian not positive definite with damping %g; doubling it", damp)
        for i in range(k):  # the lower part was overwritten: the upper half still holds the matrix
            a[i + 1:, i] = a[i, i + 1:]
        damp *= 2.0
    else:
        raise np.linalg.LinAlgError("the Hessian stayed singular after 20 doublings of its damping")
    _, info = lapack.strtri(a.T, lower=0, overwrite_c=1)
    if info != 0:
        raise np.linalg.LinAlgError(f"the Cholesky factor could not be inverted (LAPACK info {info})")
    for i in range(k - 1):
        a[i, i + 1:] = 0.0


def _reverse_in_place(a: np.ndarray, chunk: int = 1 << 22) -> None:
    """``a[::-1, ::-1]`` into ``a`` itself (C-ordered: the flat buffer reversed), a chunk at a time."""
    flat = a.reshape(-1)
    n = flat.size
    for i in range(0, n // 2, chunk):
        j = min(i + chunk, n // 2)
        head = flat[i:j].copy()
        flat[i:j] = flat[n - j:n - i][::-1]
        flat[n - j:n - i] = head[::-1]


def _search(rows: np.ndarray, weights: np.ndarray, s: np.ndarray, z: np.ndarray | None, bits: int,
            symmetric: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Per column of one block's ``rows [block, N]``, the scale among ``s·f`` (f in SCALE_FACTORS) of least
    weighted error. One ``[block, N]`` buffer, worked in place along the rows (the Gemma-3 LM head's 262144
    columns: 830 -> 244 ms a block)."""
    qmax = (1 << bits) - 1
    best_s, best_z = s.copy(), None if z is None else z.copy()
    best = np.full(s.shape, np.inf)
    wts = weights.astype(np.float32)[:, None]
    q = np.empty_like(rows, dtype=np.float32)
    for f in SCALE_FACTORS:
        if symmetric:
            sf = (s * f).astype(np.float32)
            zf = np.full(s.shape, float(1 << (bits - 1)), np.float32)
        else:  # shrink the range around zero, as GPTQ's own grid search does
            lo = -(z if z is not None else 0.0) * s * f
            sf = (s * f).astype(np.float32)
            safe0 = np.where(sf == 0, 1.0, sf)
            zf = np.clip(np.rint(-lo / safe0), 0, qmax).astype(np.float32)
        safe = np.where(sf == 0, 1.0, sf)
        np.divide(rows, safe, out=q)  # q = (clip(rint(rows / safe) + zf, 0, qmax) - zf) * sf
        np.rint(q, out=q)
        q += zf
        np.clip(q, 0, qmax, out=q)
        q -= zf
        q *= sf
        np.subtract(rows, q, out=q)  # the weighted squared error
        np.square(q, out=q)
        q *= wts
        loss = q.sum(axis=0)
        better = loss < best
        best = np.where(better, loss, best)
        best_s = np.where(better, sf, best_s)
        if best_z is not None:
            best_z = np.where(better, zf, best_z)
    return best_s.astype(np.float32), best_z
