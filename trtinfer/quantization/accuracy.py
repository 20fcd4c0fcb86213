"""The accuracy report of a quantized graph: perplexity on a held-out text and top-1 agreement with fp32.

Both graphs score the same tokens (the first ``EVAL_TOKENS`` of the GNU GPL v3 text shipped with the package, a
real English text the default calibration set does not contain), one sequence, through the runtime's scoring
path. ``top1_agreement`` is the share of positions where both graphs predict the same next token.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from trtinfer.stages import StageDir, graph_io

log = logging.getLogger(__name__)

EVAL_TEXT = "gpl-3.0"
EVAL_TOKENS = 1024


def held_out_ids(tokenizer_json: Path, max_tokens: int) -> list[int]:
    """The first ``max_tokens`` tokens of the held-out text, tokenized like ``tokenizer(text)``."""
    from tokenizers import Tokenizer

    from trtinfer.calibration.data import builtin_text

    return list(Tokenizer.from_file(str(tokenizer_json)).encode(builtin_text(EVAL_TEXT)).ids[:max_tokens])


def accuracy_report(fp32: StageDir, quantized_folder: Path, *, tokens: int = EVAL_TOKENS,
                    progress: bool = False) -> dict[str, Any]:
    """Score the fp32 stage and the quantized graph in ``quantized_folder`` on the held-out text; compare."""
    from trtinfer.runtime.scoring import open_stage_session, score_ids

    t0 = time.perf_counter()
    opt = fp32.history["optimize"]["config"]
    n = min(tokens, int(opt["max_seq_len"]))
    ids = held_out_ids(fp32.path / "tokenizer.json", n)
    quantized = StageDir(quantized_folder, {**fp32.info, "io": graph_io(quantized_folder / "model.onnx")})
    results = []
    for stage in (fp32, quantized):
        with open_stage_session(stage) as sess:
            results.append(score_ids(sess, ids, what="the held-out text"))
    ref, got = results
    agree = float((ref.argmax == got.argmax).mean())
    report = {"text": f"builtin:{EVAL_TEXT}", "tokens": len(ids), "perplexity": round(got.perplexity, 4),
              "perplexity_fp32": round(ref.perplexity, 4), "ratio": round(got.perplexity / ref.perplexity, 4),
              "top1_agreement": round(agree, 4), "seconds": round(time.perf_counter() - t0, 2)}
    if not math.isfinite(got.perplexity):
        log.warning("the quantized graph's perplexity is not finite")
    log.debug("accuracy: %s", report)
    return report


def accuracy_text(acc: dict[str, Any] | None) -> str:
    """One line for a person."""
    if not acc:
        return "accuracy: not measured"
    return (f"accuracy on {acc['tokens']} held-out tokens ({acc['text']}): perplexity {acc['perplexity']:.3f} vs "
            f"fp32 {acc['perplexity_fp32']:.3f} (x{acc['ratio']:.3f}), top-1 agreement {acc['top1_agreement']:.1%}")
