"""Second-order statistics for GPTQ: ``X^T X`` of each quantized MatMul's input over calibration data.

The optimized fp32 graph runs on the calibration set (prefill windows and teacher-forced decode steps, so
decode-time activations count), piece by piece (:mod:`trtinfer.calibration.pieces`: about a GiB of weights at a
time, a decoder layer or a few), so neither the fp32 model nor every statistic is ever held at once: each distinct
MatMul input tensor (q/k/v share one) gets one accumulator, made when its piece runs, and the Hessians of a piece
are handed over when it ends.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from trtinfer.quantization.registry import QuantContext
from trtinfer.quantization.weights import WeightSite

log = logging.getLogger(__name__)


def matmul_hessians(ctx: QuantContext, sites: Sequence[WeightSite], *,
                    budget: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """``{site.name: H [K, K]}`` of the sites of each piece of the graph in turn (``budget``: weight bytes of a
    piece, :data:`~trtinfer.calibration.pieces.PIECE_BYTES` by default); records the calibration set in
    ``ctx.notes["calibration"]`` once every piece ran.

    The graph is asked for the logits of every position, so the LM head's input counts every token (with the
    last-position logits generation uses, it would see one row per run).
    """
    from trtinfer.calibration import stage_calibration_set
    from trtinfer.calibration.data import StageFeeds
    from trtinfer.calibration.pieces import PIECE_BYTES, collect_in_pieces
    from trtinfer.quantization.gptq import HessianAccumulator

    cal = ctx.config.calibration
    wanted = [s for s in sites if s.node.inputs[0] is not None]
    width: dict[str, int] = {}
    readers: dict[str, list[WeightSite]] = {}
    for s in wanted:
        name = s.node.inputs[0].name  # type: ignore[union-attr]
        assert name is not None
        width.setdefault(name, s.k)
        readers.setdefault(name, []).append(s)
    cset = stage_calibration_set(ctx.stage, cal.source, num_samples=cal.num_samples, seq_len=cal.seq_len,
                                 decode_steps=cal.decode_steps)
    acc: dict[str, HessianAccumulator] = {}

    def add(tensor: str, x: np.ndarray) -> None:
        if tensor not in acc:
            acc[tensor] = HessianAccumulator(width[tensor])
        acc[tensor].add(x)

    pieces = 0
    feeds = StageFeeds(ctx.stage, cset, all_logits=True)
    for done in collect_in_pieces(ctx.stage, feeds, list(width), add, budget=budget or PIECE_BYTES,
                                  scratch=ctx.scratch, progress=ctx.progress):
        pieces += 1
        hessians: dict[str, np.ndarray] = {}
        for name in done:  # one matrix per input, shared by its MatMuls (q/k/v)
            h = acc.pop(name).hessian()
            hessians.update((s.name, h) for s in readers[name])
        yield hessians
    info: dict[str, Any] = {"samples": len(cset), "runs": len(feeds), "pieces": pieces,
                            "dataset_hash": cset.dataset_hash, "source": str(cal.source) if cal.source else "builtin",
                            "tensors": len(width)}
    ctx.notes["calibration"] = info
    log.debug("GPTQ statistics: %s", info)
