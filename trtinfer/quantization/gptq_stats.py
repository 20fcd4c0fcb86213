"""Second-order statistics for GPTQ: ``X^T X`` of each quantized MatMul's input over calibration data.

The optimized fp32 graph runs on the calibration set (prefill windows and teacher-forced decode steps, so
decode-time activations count); each distinct MatMul input tensor (q/k/v share one) gets one accumulator.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from trtinfer.quantization.registry import QuantContext
from trtinfer.quantization.weights import WeightSite

log = logging.getLogger(__name__)


def matmul_hessians(ctx: QuantContext, sites: Sequence[WeightSite]) -> dict[str, np.ndarray]:
    """``{site.name: H [K, K]}`` for ``sites``; records the calibration set in ``ctx.notes["calibration"]``.

    The graph is asked for the logits of every position, so the LM head's input counts every token (with the
    last-position logits generation uses, it would see one row per run).
    """
    from trtinfer.calibration import calibration_set, collect
    from trtinfer.calibration.data import StageFeeds
    from trtinfer.quantization.gptq import HessianAccumulator

    cal = ctx.config.calibration
    wanted = [s for s in sites if s.node.inputs[0] is not None]
    acc: dict[str, HessianAccumulator] = {}
    for s in wanted:
        name = s.node.inputs[0].name  # type: ignore[union-attr]
        assert name is not None
        acc.setdefault(name, HessianAccumulator(s.k))
    cset = calibration_set(ctx.stage.path / "tokenizer.json", cal.source, num_samples=cal.num_samples,
                           seq_len=cal.seq_len, decode_steps=cal.decode_steps)

    def add(tensor: str, x: np.ndarray) -> None:
        acc[tensor].add(x)

    runs = collect(ctx.stage, StageFeeds(ctx.stage, cset, all_logits=True), list(acc), add, progress=ctx.progress)
    info: dict[str, Any] = {"samples": len(cset), "runs": runs, "dataset_hash": cset.dataset_hash,
                            "source": str(cal.source) if cal.source else "builtin", "tensors": len(acc)}
    ctx.notes["calibration"] = info
    log.debug("GPTQ statistics: %s", info)
    hessians = {name: a.hessian() for name, a in acc.items()}  # one matrix per input, shared by its MatMuls (q/k/v)
    return {s.name: hessians[s.node.inputs[0].name] for s in wanted}  # type: ignore[union-attr,index]
