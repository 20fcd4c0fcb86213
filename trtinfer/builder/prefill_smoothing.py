"""SmoothQuant for the int8 prefill graph's down projections, its strength searched per layer on calibration rows.

A down projection's input (``act(gate) * up``) has outlier channels that one int8 scale per token rounds badly. So
``x W = (x / s) (diag(s) W)`` with ``s_j = max|x_j| ** a / max|W_j| ** (1 - a)`` (Xiao et al. 2023; the factors of
:func:`~trtinfer.quantization.smoothquant.smoothing_factors`); ``1/s`` goes into the up projection's per-output-channel
scales (:func:`fold_target`), or one Mul where none can take it. The strength ``a`` is chosen per layer as AWQ
chooses its scales: each of :data:`ALPHAS` (and no smoothing at all) is tried on rows of that layer's input sampled
from the calibration text, and the one whose per-token int8 product is nearest the float product in squared error
(so tokens of large activations, the attention sinks among them, weigh by their size) is kept. Statistics are taken
on the stage's graph (the model before compilation; the down projections' inputs keep their names) over
:data:`WINDOWS` x :data:`TOKENS` tokens of the built-in calibration text (never the held-out text the build's check
scores), every :data:`ROW_STRIDE`-th row kept.

Measured (held-out perplexity of the prefill graph over the decoder's alone, SmolLM2 fp32 / int4, Gemma-3 fp32 /
int4, one build each): chosen per layer by squared error x1.011 / 0.995 / 1.023 / 1.004; one strength for all layers,
a = 0.6: x1.010 / 1.014 / 1.024 / 1.025, a = 0.5: x1.031 / 1.041 / 1.033 / 1.008, a = 0.5 on the 99.9th percentile of
``|x_j|`` instead of its max: x1.022 / 1.016 / 1.017 / 1.010; chosen per layer by the mean of each row's relative
error (every token alike): SmolLM2 fp32 x1.067 (the sinks' rows err most), by its maximum or root mean square:
x1.031-1.057 for SmolLM2 fp32. Every GEMM in int8 without smoothing: SmolLM2 fp32 x1.031; the down projections on
the decoder's kernel: x1.016 / 0.998 / 1.006 / 1.009 at 1.3-1.4x the TTFT (docs/benchmarks/cpu.md).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from trtinfer.artifact import StageDir

log = logging.getLogger(__name__)

#: the strengths tried per layer (None: no smoothing)
ALPHAS: tuple[float | None, ...] = (None, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: windows x tokens of the built-in calibration text the statistics are taken over
WINDOWS, TOKENS = 8, 128
#: every this many rows of a layer's input are kept for the search (256 of 1,024: 50 MB at a 12,288-wide input)
ROW_STRIDE = 4

Gemm = tuple[ir.Node, tuple[int, int, Callable[[], np.ndarray]]]


@dataclass
class InputStats:
    """One down projection's input over the calibration text: per-channel ``max|x|`` over every row, sampled rows."""

    amax: np.ndarray
    rows: np.ndarray


class _Collector:
    """Per-channel ranges of each tensor (:class:`~trtinfer.calibration.ChannelRangeCollector`) and every
    :data:`ROW_STRIDE`-th of its finite rows."""

    def __init__(self) -> None:
        from trtinfer.calibration import ChannelRangeCollector

        self.ranges = ChannelRangeCollector()
        self.rows: dict[str, list[np.ndarray]] = {}

    def update(self, tensor: str, batch: np.ndarray) -> None:
        self.ranges.update(tensor, batch)
        x = np.asarray(batch, dtype=np.float32)
        x = x.reshape(-1, x.shape[-1])[::ROW_STRIDE]
        self.rows.setdefault(tensor, []).append(x[np.isfinite(x).all(axis=1)].copy())


def input_stats(stage: StageDir, names: Sequence[str]) -> dict[str, InputStats]:
    """:class:`InputStats` of the tensors ``names`` of ``stage``'s graph over the calibration text."""
    from trtinfer.calibration import StageFeeds, collect, stage_calibration_set

    cset = stage_calibration_set(stage, None, num_samples=WINDOWS, seq_len=TOKENS, decode_steps=0)
    got = _Collector()
    collect(stage, StageFeeds(stage, cset), list(names), got.update, progress=False)
    return {n: InputStats(r.amax, np.concatenate(got.rows[n])) for n, r in got.ranges.ranges().items()}


def _per_row_int8(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to int8 per row, as the prefill graph does (max|x| / 127 a row, half to even), dequantized."""
    s = np.maximum(np.abs(x).max(axis=-1, keepdims=True), np.float32(1e-12)) / np.float32(127.0)
    return np.clip(np.rint(x / s), -127, 127) * s  # type: ignore[no-any-return]


def best_smoothing(w: np.ndarray, stats: InputStats) -> tuple[np.ndarray | None, float | None]:
    """``(s, a)`` of the strength in :data:`ALPHAS` whose int8 product of the sampled rows with ``w [K, N]`` is
    nearest the float product in squared error; ``(None, None)`` where no smoothing is nearest."""
    from trtinfer.quantization.int8_static import per_channel_int8
    from trtinfer.quantization.smoothquant import row_amax, smoothing_factors

    x = stats.rows
    want = x @ w
    w_amax = row_amax(w)
    best: tuple[float, np.ndarray | None, float | None] = (np.inf, None, None)
    for a in ALPHAS:
        s = None if a is None else smoothing_factors(stats.amax, w_amax, a)
        codes, scales = per_channel_int8(w if s is None else w * s[:, None])
        got = _per_row_int8(x if s is None else x / s) @ codes.astype(np.float32) * scales
        got -= want
        err = float(np.vdot(got, got))
        if err < best[0]:
            best = (err, s, a)
    return best[1], best[2]


def gemm_bias(node: ir.Node) -> ir.Value | None:
    """A ``MatMulNBits`` node's bias input (added to its product), else None."""
    return node.inputs[5] if node.op_type == "MatMulNBits" and len(node.inputs) > 5 else None


def fold_target(x: ir.Value, rewritten: Mapping[int, ir.Node]) -> ir.Node | None:
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
                and all(u.node is mul for u in v.uses()) and gemm_bias(up) is None):
            return up
    return None


@dataclass
class Plan:
    """Per node id: ``rows`` (``s``, scaling a down projection's weight rows), ``cols`` (``1/s``, scaling an up
    projection's weight columns); the down projections whose ``1/s`` was so folded; the strength chosen per down
    projection (in graph order; None: not smoothed, yet in int8)."""

    rows: dict[int, np.ndarray]
    cols: dict[int, np.ndarray]
    folded: set[int]
    alphas: list[float | None]


def plan(gemms: Sequence[Gemm], downs: set[int], stats: Mapping[str, InputStats]) -> Plan:
    """The smoothing of the down projections ``downs`` (node ids) whose input has ``stats``; ``gemms`` are every
    GEMM the prefill graph rewrites (an up projection among them can take ``1/s``)."""
    rewritten = {id(node): node for node, _ in gemms}
    out = Plan({}, {}, set(), [])
    for node, (_k, _n, read) in gemms:
        x = node.inputs[0]
        if id(node) not in downs or x is None or x.name is None or x.name not in stats:
            continue
        s, a = best_smoothing(read(), stats[x.name])
        out.alphas.append(a)
        if s is None:
            continue
        out.rows[id(node)] = s
        up = fold_target(x, rewritten)
        if up is not None and id(up) not in out.cols:
            out.cols[id(up)] = (np.float32(1.0) / s).astype(np.float32)
            out.folded.add(id(node))
    return out
