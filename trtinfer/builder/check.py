"""Engine check at build time: the finished engine, driven by the runtime, against the exported graph.

The exported graph was validated against PyTorch eager (``export.validation``); this checks that what the passes,
the precision conversion and ONNX Runtime's optimizer made of it still computes the same logits, through the real
runtime path (ragged batch, the engine's KV layout and dtypes, decode steps). Engine vs eager is then bounded by
the sum of the two differences, both recorded in the manifest.

The reference runs each row alone on the fp32 export (no padding, growing KV); the engine runs the rows as one
ragged batch and is fed the reference's greedy tokens, so both see the same sequence at every step.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.runtime.manifest import Manifest

log = logging.getLogger(__name__)

# max |engine - export| over logits, relative to max(1, max |logits|). fp32: reduction-order noise of fused ops.
# fp16 on ORT CPU kernels: tiny random models ~1e-3, SmolLM2 2.2e-3 (0.065 on logits of magnitude 29), Gemma-3 1.07e-2
# (6.7e-3 when emulated with fp32 arithmetic, as GPUs accumulate); bf16 keeps 3 fewer mantissa bits than fp16
TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 8e-2}
PROMPT_LENGTHS = (11, 6)
DECODE_STEPS = 4


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


def reference_logits(export_onnx: Path, prompts: list[np.ndarray], steps: int) -> list[tuple[np.ndarray, list[int]]]:
    """Each prompt alone on the exported (concat-layout, fp32) graph: greedy for ``steps``; logits per position."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(export_onnx), providers=["CPUExecutionProvider"])
    past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    out = []
    for p in prompts:
        n = len(p)
        feeds: dict[str, np.ndarray] = {"input_ids": p[None], "attention_mask": np.ones((1, n), np.int64),
                                        "position_ids": np.arange(n)[None]}
        feeds.update({x.name: np.zeros((1, x.shape[1], 0, x.shape[3]), np.float32) for x in past})
        res = sess.run(None, feeds)
        logits, toks = [res[0][0, -1]], []
        for _ in range(steps):
            toks.append(int(np.argmax(logits[-1])))
            feeds = {"input_ids": np.array([[toks[-1]]]), "attention_mask": np.ones((1, n + 1), np.int64),
                     "position_ids": np.array([[n]])}
            feeds.update({x.name: v for x, v in zip(past, res[1:])})
            res = sess.run(None, feeds)
            logits.append(res[0][0, -1])
            n += 1
        out.append((np.stack(logits), toks))
    return out


def check_engine(engine_dir: Path, manifest: Manifest, export_onnx: Path, precision: str,
                 provider: str = "cpu") -> EngineCheck:
    """Compare the engine in ``engine_dir`` (described by ``manifest``) with ``export_onnx`` (see the module doc)."""
    from trtinfer.runtime.config import RuntimeConfig
    from trtinfer.runtime.session import open_session

    vocab = int(manifest.geometry["vocab_size"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, n).astype(np.int64) for n in PROMPT_LENGTHS]
    ref = reference_logits(export_onnx, prompts, DECODE_STEPS)
    with open_session(engine_dir, manifest, RuntimeConfig(provider=provider)) as sess:
        logits, kv = sess.prefill([p.tolist() for p in prompts], max(PROMPT_LENGTHS) + DECODE_STEPS + 1)
        got = [logits.astype(np.float32)]
        for t in range(DECODE_STEPS):
            logits, kv = sess.decode(np.array([r[1][t] for r in ref]), kv)
            got.append(logits.astype(np.float32))
    ours = np.stack(got, axis=1)  # [rows, steps + 1, vocab]
    theirs = np.stack([r[0] for r in ref])
    scale = float(max(1.0, np.abs(theirs).max()))
    diff = float(np.abs(ours - theirs).max())
    tol = TOLERANCE[precision]
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    result = EngineCheck("exported fp32 graph (validated against eager)", precision, PROMPT_LENGTHS, DECODE_STEPS,
                         diff, scale, tol, top1, diff <= tol * scale)
    log.info("engine check: %s", result)
    return result
