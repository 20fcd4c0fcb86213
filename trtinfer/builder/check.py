"""Engine checks at build time: the finished engine, driven by the runtime, against the exported graph; and, for a
quantized engine, its accuracy on held-out text against the fp32 graph (:func:`check_accuracy`).

The exported graph was validated against PyTorch eager (``export.validation``); this checks that what the passes,
the precision conversion and ONNX Runtime's optimizer made of it still computes the same logits, through the real
runtime path (ragged batch, the engine's KV layout and dtypes, decode steps). Engine vs eager is then bounded by
the sum of the two differences, both recorded in the manifest.

The reference (``reference.npz``, computed by the export stage) ran each row alone on the fp32 export (no padding,
growing KV); the engine runs the rows as one ragged batch and is fed the reference's greedy tokens, so both see
the same sequence at every step.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import Manifest
from trtinfer.builder.config import FLOAT_PRECISIONS

log = logging.getLogger(__name__)

# max |engine - export| over logits, relative to max(1, max |logits|). fp32: reduction-order noise of fused ops.
# fp16 on ORT CPU kernels: tiny random models ~1e-3, SmolLM2 2.2e-3 (0.065 on logits of magnitude 29), Gemma-3 1.07e-2
# (6.7e-3 when emulated with fp32 arithmetic, as GPUs accumulate); bf16 keeps 3 fewer mantissa bits than fp16
TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 8e-2}
# quantized engines are checked against their own quantize-stage graph: int8 activation rounding (accuracy level 4)
# may round a value differently after ONNX Runtime's offline rewrites; anything larger is a broken compile
QUANTIZED_TOLERANCE = 2e-2
# int8-static (SmoothQuant) on ONNX Runtime CPU: the fused norm's output differs from the unfused graph's by ~1e-6,
# which flips one int8 activation code; SmolLM2's layer 11 (activations of ~3,400) amplifies it to 2.05 on logits of
# 27.9 (0.073). Past this only a broken compile: the engine's held-out accuracy (check_accuracy) is the real gate.
QUANTIZED_TOLERANCES = {"int8-static": 0.15}
#: an int8 prefill graph (``--prefill int8``): held-out perplexity of the engine with it over the same engine without
#: it (every pass on the decoder graph), past which the graph is written again without smoothed down projections, and
#: past which that one fails the build; measured on 1,024 tokens: x0.995-1.023 smoothed (SmolLM2, Gemma-3; fp32, int4)
PREFILL_BOUND = 1.03


@dataclass(frozen=True)
class EngineCheck:
    """How far the engine's logits are from the exported graph's, on a ragged batch plus decode steps."""

    reference: str
    precision: str
    prompt_lengths: tuple[int, ...]
    decode_steps: int
    max_abs_diff: float
    logits_scale: float
    tolerance: float
    top1_agreement: float
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the manifest."""
        d = asdict(self)
        d["prompt_lengths"] = list(self.prompt_lengths)
        return d

    def summary(self) -> str:
        """One line for a person."""
        verdict = "passed" if self.passed else "FAILED"
        return (f"engine check vs {self.reference} ({self.precision}): max|diff| {self.max_abs_diff:.3g} "
                f"{'<=' if self.passed else '>'} {self.tolerance:g} x {self.logits_scale:.3g}, "
                f"top-1 agreement {self.top1_agreement:.0%}: {verdict}")


def _runtime_logits(sess: Any, prompts: list[np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """The reference protocol through a runtime session's slot cache: the ragged prompts (one call where the graph
    reads each row's own last position), then the given tokens as batched decode steps; ``[rows, steps+1, V]``."""
    from trtinfer.runtime.slots import SlotCache

    rows, steps = len(prompts), tokens.shape[1]
    cache = SlotCache(sess, rows, max(len(p) for p in prompts) + steps + 1, reserve=False)
    try:
        ids = [p.tolist() for p in prompts]
        got = [np.stack(cache.prefill_rows(0, ids)).astype(np.float32)]
        for t in range(steps):
            out = cache.decode({r: int(tokens[r, t]) for r in range(rows)})
            got.append(np.stack([out[r] for r in range(rows)]).astype(np.float32))
    finally:
        cache.close()
    return np.stack(got, axis=1)


def check_engine(engine_dir: Path, manifest: Manifest, reference: Path, precision: str,
                 provider: str = "cpu", graph: Any = None) -> EngineCheck:
    """Compare the engine in ``engine_dir`` (described by ``manifest``) with the export's stored ``reference``.

    ``graph`` (a quantize stage): compare with that graph instead, run through the same runtime protocol on the
    reference's prompts and tokens. A quantized graph differs from fp32 by design (the accuracy report measures how
    much); what the engine check guards is that compiling it changed nothing beyond int8 rounding.
    """
    from trtinfer.export.reference import load_reference
    from trtinfer.runtime.config import RuntimeConfig
    from trtinfer.runtime.session import open_session

    prompts, tokens, theirs = load_reference(reference)
    steps = tokens.shape[1]
    # a float engine's weights are read in place: MLAS's packed copy would double the build's peak (Gemma-3-270M fp32
    # 2.2 GiB) to run the same fp32 arithmetic; a quantized engine keeps it (packing picks MatMulNBits' int8 kernels)
    lean = precision in FLOAT_PRECISIONS
    # the decoder graph alone: an int8 prefill graph differs by design and is judged by check_prefill
    config = RuntimeConfig(provider=provider, prepack_weights=False if lean else None, prefill_graph=False,
                           huge_pages=False)
    with open_session(engine_dir, manifest, config) as sess:
        ours = _runtime_logits(sess, prompts, tokens)
    what = "exported fp32 graph"
    tol = TOLERANCE.get(precision, QUANTIZED_TOLERANCES.get(precision, QUANTIZED_TOLERANCE))
    if graph is not None:
        from trtinfer.runtime.scoring import open_stage_session

        with open_stage_session(graph, RuntimeConfig(provider=provider, huge_pages=False)) as sess:
            theirs = _runtime_logits(sess, prompts, tokens)
        what = f"{precision} quantize-stage graph"
    scale = float(max(1.0, np.abs(theirs).max()))
    diff = float(np.abs(ours - theirs).max()) if np.isfinite(ours).all() else float("inf")
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    result = EngineCheck(what, precision,
                         tuple(len(p) for p in prompts), steps, diff, scale, tol, top1, diff <= tol * scale)
    log.debug("%s", result.summary())
    return result


def check_accuracy(engine_dir: Path, manifest: Manifest, heldout: Path, provider: str = "cpu") -> dict[str, Any]:
    """Score the engine on the held-out ids the fp32 graph scored in the quantize stage (``heldout``); compare.

    The engine runs the kernels its users get, so a kernel path that breaks the quantized arithmetic (which its own
    quantize-stage graph, run unfused, cannot show) moves this figure. Returns
    :func:`~trtinfer.quantization.accuracy.compare_scores`' report; the build judges it against the bound.
    """
    from trtinfer.quantization.accuracy import compare_scores
    from trtinfer.runtime.config import RuntimeConfig
    from trtinfer.runtime.scoring import score_ids
    from trtinfer.runtime.session import open_session

    ref = np.load(heldout)
    with open_session(engine_dir, manifest, RuntimeConfig(provider=provider, huge_pages=False)) as sess:
        got = score_ids(sess, ref["ids"].tolist(), what="the held-out text")
    report = compare_scores(ref["logprobs"], ref["argmax"], got.logprobs, got.argmax,
                            manifest.geometry["vocab_size"])
    log.debug("engine accuracy: %s", report)
    return report


def check_prefill(engine_dir: Path, manifest: Manifest, tokenizer_json: Path) -> dict[str, Any]:
    """Score the held-out text with the engine's int8 prefill graph and without it (every pass on the decoder graph,
    which the engine check compared with the export); the ratio of the two perplexities is what the prefill graph
    costs, judged against :data:`PREFILL_BOUND`."""
    from trtinfer.quantization.accuracy import EVAL_TOKENS, compare_scores, held_out_ids
    from trtinfer.runtime.config import RuntimeConfig
    from trtinfer.runtime.scoring import score_ids
    from trtinfer.runtime.session import open_session

    vocab = int(manifest.geometry["vocab_size"])
    ids = held_out_ids(tokenizer_json, min(EVAL_TOKENS, manifest.max_seq_len), vocab)
    scores = {}
    for use in (False, True):
        with open_session(engine_dir, manifest, RuntimeConfig(prefill_graph=use, huge_pages=False)) as sess:
            scores[use] = score_ids(sess, ids, what="the held-out text")
    r = compare_scores(scores[False].logprobs, scores[False].argmax, scores[True].logprobs, scores[True].argmax, vocab)
    report = {"text": r["text"], "tokens": r["tokens"], "perplexity": r["perplexity"],
              "perplexity_decoder": r["perplexity_fp32"], "ratio": r["ratio"], "top1_agreement": r["top1_agreement"],
              "bound": PREFILL_BOUND, "passed": bool(r["ratio"] <= PREFILL_BOUND)}
    log.debug("prefill check: %s", report)
    return report
