"""The accuracy report of a quantized graph: perplexity on a held-out text and top-1 agreement with fp32.

Both graphs score the same tokens (the first ``EVAL_TOKENS`` of the GNU GPL v3 text shipped with the package, a
real English text the default calibration set does not contain), one sequence, through the runtime's scoring
path. ``top1_agreement`` is the share of positions where both graphs predict the same next token.

The fp32 graph's scores are kept in the quantize stage (``HELDOUT_NAME``), so the build scores the compiled engine
itself against them (:func:`trtinfer.builder.check.check_accuracy`): the engine runs the kernels users get (ONNX
Runtime's fused integer paths, which the quantize stage's unfused graph does not), and its perplexity ratio must stay
within the precision's bound (``PERPLEXITY_BOUNDS``) or the build fails.
"""
from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import StageDir
from trtinfer.stages import graph_io

log = logging.getLogger(__name__)

EVAL_TEXT = "gpl-3.0"
EVAL_TOKENS = 1024
#: the fp32 graph's scores of the held-out ids, written into the quantize stage for the build's accuracy check
HELDOUT_NAME = "heldout_fp32.npz"
#: the cache's ``scores`` entries (an fp32 stage's held-out scores): bump when scoring changes what it computes
SCORES_FORMAT = 1
#: the largest perplexity ratio (quantized / fp32 on the held-out text) a build accepts, per precision; measured
#: (README, benchmarks/results): int8 0.997-1.006, gguf 1.001-1.002, int4 (GPTQ) 1.066-1.091 on SmolLM2 / Gemma-3
PERPLEXITY_BOUNDS = {"int8": 1.05, "int8-static": 1.05, "gguf": 1.02, "int4": 1.15}
#: The bound holds both ways (ratio within [1/bound, bound]): quantization noise does not make a model much *better*
#: on text it never saw, while a broken graph can: a random-weight tiny Llama with one block-scale tensor x100 scored
#: x0.77 with 2.8% top-1 agreement. Hence also a floor on top-1 agreement, below any sound engine's (tiny random
#: models, whose near-flat predictions flip easily: int4 round-to-nearest 45%, GPTQ 73%, int8 96%; SmolLM2
#: int8-static 85%), that only a graph computing something else falls under.
MIN_TOP1_AGREEMENT = 0.25
#: ... but only where the fp32 model predicts the text at all: a model whose fp32 perplexity is this share of its
#: vocabulary or more is near-uniform there (seeded random-weight checkpoints at real size: Llama-3.2-1B shape
#: perplexity 202,041 on a 128,256 vocabulary), its argmax a coin toss (int4 RTN agreed on 9.2% at x0.984), so the
#: ratio bound alone judges it
NEAR_UNIFORM_SHARE = 0.25
#: node-name patterns a quantize stage leaves in fp32 and quantizes again when the graph with every GEMM quantized
#: misses its precision's bound (TensorRT users' per-layer precision fallback). int8-static: the down_proj inputs
#: (SiLU(gate) * up) keep most of the range per-tensor activations cannot hold even after SmoothQuant; Gemma-3-270M
#: measured x1.058-1.061 with every GEMM, x1.035-1.038 with down_proj in fp32 (+67 MiB; o_proj 1.094, LM head 1.061:
#: no other single group helped), SmolLM2 x1.018 needs no fallback.
FALLBACK_FP32 = {"int8-static": ("down_proj",)}
#: what to try when a precision misses its bound
BOUND_HINTS = {
    "int8": "leave the LM head in fp32 (--keep-fp32 lm_head)",
    "int8-static": "try --calibrator percentile or entropy, more --calibration-samples, or --keep-fp32 for the layers "
                   "at fault",
    "gguf": "use a GGUF of higher precision (Q8_0, Q6_K) or --precision int8",
    "int4": "try --method gptq, --lm-head-bits 8 or --block-size 32",
}


def held_out_ids(tokenizer_json: Path, max_tokens: int, vocab_size: int | None = None) -> list[int]:
    """The first ``max_tokens`` tokens of the held-out text, tokenized like ``tokenizer(text)``; with
    ``vocab_size``, only ids below it (a model cut to its first tokens scores the text's tokens it has)."""
    from tokenizers import Tokenizer

    from trtinfer.calibration.data import builtin_text

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(builtin_text(EVAL_TEXT)).ids
    return [i for i in ids if vocab_size is None or i < vocab_size][:max_tokens]


def accuracy_report(fp32: StageDir, quantized_folder: Path, *, tokens: int = EVAL_TOKENS,
                    progress: bool = False) -> dict[str, Any]:
    """Score the fp32 stage and the quantized graph in ``quantized_folder`` on the held-out text, each run piece by
    piece (:func:`graph_scores`: memory holds about a GiB of either graph's weights at a time); compare."""
    from trtinfer.stage_weights import CHECKPOINT_COUNT

    t0 = time.perf_counter()
    opt = fp32.history["optimize"]["config"]
    n = min(tokens, int(opt["max_seq_len"]))
    ids = held_out_ids(fp32.path / "tokenizer.json", n, int(fp32.geometry["vocab_size"]))
    ref_logprobs, ref_argmax = fp32_scores(fp32, quantized_folder, ids, progress)
    quantized = StageDir(quantized_folder, {**fp32.info, "io": graph_io(quantized_folder / "model.onnx"),
                                            CHECKPOINT_COUNT: 0})  # every weight written
    logprobs, argmax = graph_scores(quantized, ids, scratch=quantized_folder, progress=progress,
                                    what="scoring the quantized graph")
    report = compare_scores(ref_logprobs, ref_argmax, logprobs, argmax, fp32.geometry["vocab_size"])
    report["seconds"] = round(time.perf_counter() - t0, 2)
    if not math.isfinite(report["perplexity"]):
        log.warning("the quantized graph's perplexity is not finite")
    log.debug("accuracy: %s", report)
    return report


def fp32_scores(fp32: StageDir, quantized_folder: Path, ids: list[int],
                progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """The fp32 graph's scores of ``ids``, saved in the quantized stage (``HELDOUT_NAME``): read back where this stage
    saved them already (its quantization tried again with a fallback: the fp32 graph is the same), else from the
    cache's ``scores`` entry of this fp32 stage (every precision built from one optimize stage scores the same fp32
    graph: minutes at 8B), else computed there. A cache that cannot be written only means they are computed here."""
    from trtinfer._cache import cached_dir, key_of
    from trtinfer.errors import OutputError
    from trtinfer.stages import package_versions

    saved = quantized_folder / HELDOUT_NAME
    if (found := _read_scores(saved, ids)) is not None:
        return found

    def score_into(folder: Path) -> None:
        logprobs, argmax = graph_scores(fp32, ids, scratch=quantized_folder, progress=progress,
                                        what="scoring the fp32 graph")
        np.savez(folder / HELDOUT_NAME, ids=np.asarray(ids, np.int64), logprobs=logprobs, argmax=argmax)

    key = key_of([SCORES_FORMAT, fp32.content_key(), ids, package_versions("onnxruntime", "numpy")])
    try:
        entry = cached_dir("scores", key, score_into)
    except OutputError as e:
        log.debug("the fp32 scores are not cached (%s); computing them", e)
        score_into(quantized_folder)
    else:
        shutil.copyfile(entry / HELDOUT_NAME, saved)
    with np.load(saved) as z:  # the key holds the ids
        return z["logprobs"], z["argmax"]


def _read_scores(path: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The saved scores in ``path`` if it holds those of ``ids``, else None."""
    if not path.is_file():
        return None
    with np.load(path) as z:
        return (z["logprobs"], z["argmax"]) if np.array_equal(z["ids"], ids) else None


def graph_scores(stage: StageDir, ids: list[int], *, budget: int | None = None, scratch: Path | None = None,
                 progress: bool = False, what: str = "scoring") -> tuple[np.ndarray, np.ndarray]:
    """log p(token t | tokens before t) for t = 1..n-1 of ``ids`` and the top-1 predictions before each, on
    ``stage``'s graph run piece by piece (:mod:`trtinfer.calibration.pieces`: about a GiB of its weights at a time,
    read from its checkpoint where they are still there; ``budget``: the bytes of a piece, ``scratch``: where its
    files go), as one prefill of every token but the last. A quantized graph's pieces let MLAS pack their weights, as
    the engine does (MatMulNBits computes differently unpacked: Gemma-3 int4 perplexity 15.73 vs 15.88); a float
    graph's read theirs in place."""
    from trtinfer.calibration.data import CalibrationSet, StageFeeds
    from trtinfer.calibration.pieces import PIECE_BYTES, collect_in_pieces
    from trtinfer.runtime.scoring import log_softmax_at

    cset = CalibrationSet((tuple(ids[:-1]),), seq_len=len(ids) - 1, decode_steps=0, source=f"builtin:{EVAL_TEXT}")
    rows: list[np.ndarray] = []
    for _ in collect_in_pieces(stage, StageFeeds(stage, cset, all_logits=True), ["logits"],
                               lambda _t, x: rows.append(x), budget=budget or PIECE_BYTES, scratch=scratch,
                               progress=progress, what=what):
        pass
    logits = rows[0].reshape(len(ids) - 1, -1)
    targets = np.asarray(ids[1:], np.int64)
    parts = [log_softmax_at(logits[i:i + 64], targets[i:i + 64]) for i in range(0, len(targets), 64)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def compare_scores(ref_logprobs: np.ndarray, ref_argmax: np.ndarray, logprobs: np.ndarray,
                   argmax: np.ndarray, vocab_size: int | None = None) -> dict[str, Any]:
    """Perplexities, their ratio and top-1 agreement of a quantized model's scores against the fp32 model's."""
    def ppl(lp: np.ndarray) -> float:
        mean = float(np.asarray(lp, np.float64).mean())
        return math.exp(-mean) if math.isfinite(mean) else math.inf

    ours, theirs = ppl(logprobs), ppl(ref_logprobs)
    return {"text": f"builtin:{EVAL_TEXT}", "tokens": len(ref_logprobs) + 1, "perplexity": round(ours, 4),
            "perplexity_fp32": round(theirs, 4), "ratio": round(ours / theirs, 4) if math.isfinite(ours) else math.inf,
            "top1_agreement": round(float((np.asarray(argmax) == np.asarray(ref_argmax)).mean()), 4),
            **({"vocab_size": int(vocab_size)} if vocab_size else {})}


def accuracy_verdict(acc: dict[str, Any], precision: str, bound: float | None) -> dict[str, Any]:
    """``acc`` (an engine's :func:`compare_scores`) judged: perplexity ratio within ``[1/B, B]`` for the precision's
    bound ``B`` and top-1 agreement at least ``MIN_TOP1_AGREEMENT`` (unless the fp32 model is near-uniform on the
    text, :data:`NEAR_UNIFORM_SHARE`); an explicit ``bound`` (the user's
    ``--max-perplexity-ratio``) replaces both with ``[1/bound, bound]`` alone."""
    limit = PERPLEXITY_BOUNDS[precision] if bound is None else float(bound)
    uniform = acc.get("vocab_size") and acc["perplexity_fp32"] >= NEAR_UNIFORM_SHARE * acc["vocab_size"]
    floor = MIN_TOP1_AGREEMENT if bound is None and not uniform else 0.0
    ratio = float(acc["ratio"])
    passed = math.isfinite(ratio) and 1 / limit <= ratio <= limit and acc["top1_agreement"] >= floor
    return {**acc, "bound": limit, "bound_set_by": "default" if bound is None else "--max-perplexity-ratio",
            "min_top1_agreement": floor, "passed": passed}


def verdict_error(acc: dict[str, Any], precision: str) -> str:
    """The one line a build that failed :func:`accuracy_verdict` stops with: the figures and what to try."""
    ratio = float(acc["ratio"])
    if not math.isfinite(ratio):
        return (f"the {precision} engine's perplexity on the held-out text is not finite: the quantized graph is "
                f"broken; {BOUND_HINTS[precision]}")
    figures = accuracy_text({k: v for k, v in acc.items() if k != "bound"}).removeprefix("accuracy ")
    accept = f"--max-perplexity-ratio {math.ceil(max(ratio, 1 / ratio) * 100) / 100:g}"
    if acc["top1_agreement"] < acc["min_top1_agreement"]:
        return (f"the {precision} engine computes something else than the fp32 graph: {figures}, under the "
                f"{acc['min_top1_agreement']:.0%} top-1 agreement any sound quantization keeps; find the layer at "
                f"fault with --keep-fp32, or accept it with {accept}")
    return (f"the {precision} engine misses its accuracy bound: {figures}, outside x{1 / acc['bound']:.3g}..x"
            f"{acc['bound']:g}; {BOUND_HINTS[precision]}, or accept it with {accept}")


def accuracy_text(acc: dict[str, Any] | None) -> str:
    """One line for a person (with the bound and verdict when ``acc`` is an engine's judged check)."""
    if not acc:
        return "accuracy: not measured"
    if "skipped" in acc:
        return f"accuracy: not measured ({acc['skipped']})"
    where = " of the quantize-stage graph (the engine is not loaded beside the build)" \
        if acc.get("scored") == "quantize-stage graph" else ""
    line = (f"accuracy{where} on {acc['tokens']} held-out tokens ({acc['text']}): perplexity {acc['perplexity']:.3f} vs "
            f"fp32 {acc['perplexity_fp32']:.3f} (x{acc['ratio']:.3f}), top-1 agreement {acc['top1_agreement']:.1%}")
    if "bound" in acc:
        by = "" if acc["bound_set_by"] == "default" else f", set by {acc['bound_set_by']}"
        line += f"; bound x{acc['bound']:g}{by}: {'passed' if acc['passed'] else 'FAILED'}"
    return line
