"""The engine check's reference, computed once on the exported graph (the one validated against eager).

Each prompt runs alone on the export (no padding, growing KV), greedy for a few steps; the logits of every step
and the greedy tokens are saved to ``reference.npz``. A build feeds the engine the same prompts as one ragged batch
and the same tokens, and compares logits (:mod:`trtinfer.builder.check`). Stored, the reference travels with the
stage directories, so a build needs neither the export graph nor the time to run it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

PROMPT_LENGTHS = (11, 6)
DECODE_STEPS = 4


def reference_logits(export_onnx: Path, prompts: list[np.ndarray], steps: int) -> list[tuple[np.ndarray, list[int]]]:
    """Each prompt alone on the exported (concat-layout, fp32) graph: greedy for ``steps``; logits per step."""
    import onnxruntime as ort

    from trtinfer.runtime.memory import stage_session_options

    so = stage_session_options(export_onnx, always=True)  # a few runs: mapped weights, no packed copy
    sess = ort.InferenceSession(str(export_onnx), so, providers=["CPUExecutionProvider"])
    past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    # an optimized graph asks which positions reach the LM head: the last one
    last = {"logits_positions": np.zeros((1, 1), np.int64)} if any(
        i.name == "logits_positions" for i in sess.get_inputs()) else {}
    out = []
    for p in prompts:
        n = len(p)
        feeds: dict[str, np.ndarray] = {"input_ids": p[None], "attention_mask": np.ones((1, n), np.int64),
                                        "position_ids": np.arange(n)[None]}
        if last:
            feeds["logits_positions"] = np.full((1, 1), n - 1, np.int64)
        feeds.update({x.name: np.zeros((1, x.shape[1], 0, x.shape[3]), np.float32) for x in past})
        res = sess.run(None, feeds)
        logits, toks = [res[0][0, -1]], []
        for _ in range(steps):
            toks.append(int(np.argmax(logits[-1])))
            feeds = {"input_ids": np.array([[toks[-1]]]), "attention_mask": np.ones((1, n + 1), np.int64),
                     "position_ids": np.array([[n]]), **last}
            feeds.update({x.name: v for x, v in zip(past, res[1:])})
            res = sess.run(None, feeds)
            logits.append(res[0][0, -1])
            n += 1
        out.append((np.stack(logits), toks))
    return out


def write_reference(export_onnx: Path, path: Path, vocab_size: int) -> None:
    """Run :func:`reference_logits` on fixed random prompts (seed 0) and save prompts, tokens and logits."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab_size, n).astype(np.int64) for n in PROMPT_LENGTHS]
    ref = reference_logits(export_onnx, prompts, DECODE_STEPS)
    arrays: dict[str, Any] = {f"prompt_{i}": p for i, p in enumerate(prompts)}
    arrays["tokens"] = np.array([r[1] for r in ref], dtype=np.int64)  # [rows, steps]
    arrays["logits"] = np.stack([r[0] for r in ref]).astype(np.float32)  # [rows, steps + 1, vocab]
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_reference(path: Path) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """``(prompts, tokens [rows, steps], logits [rows, steps + 1, vocab])`` from :func:`write_reference`'s file."""
    with np.load(path) as z:
        prompts = [z[f"prompt_{i}"] for i in range(len([k for k in z.files if k.startswith("prompt_")]))]
        return prompts, z["tokens"], z["logits"]
