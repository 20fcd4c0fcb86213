"""Compare an exported decoder graph with PyTorch eager: prefill, then one decode step.

The reference is the unwrapped transformers model with its own masks and cache, so the check covers our
mask construction as well as the trace. Present KV is compared on real (unpadded) positions only, and on the
positions transformers keeps: its sliding layers drop the oldest ones.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationReport:
    """Max abs differences ONNX Runtime vs eager, the tolerance applied, and whether it passed."""

    prefill_logits_max_abs_diff: float
    decode_logits_max_abs_diff: float
    present_max_abs_diff: float
    logits_scale: float
    tolerance: float
    top1_agree: bool
    passed: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


def _reference_step(model: Any, ids: Any, mask: Any, pos: Any, cache: Any) -> tuple[np.ndarray, Any]:
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[:, -1:].float().numpy(), out.past_key_values


def _onnx_steps(onnx_path: Path, geometry: dict[str, Any], ids: np.ndarray, mask: np.ndarray,
                pos: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Prefill then one decode step (on the prefill's own greedy token) in ONNX Runtime; the session is closed
    before eager runs, so the two never hold the weights at once. Returns both steps' outputs and the token fed."""
    import onnxruntime as ort

    from trtinfer.runtime.memory import stage_session_options

    so = stage_session_options(onnx_path, always=True)  # a few runs: mapped weights, no packed copy
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    n_layers, kv, hd = geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"]
    feed: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    for i in range(n_layers):
        feed[f"past_key_values.{i}.key"] = np.zeros((2, kv, 0, hd), np.float32)
        feed[f"past_key_values.{i}.value"] = np.zeros((2, kv, 0, hd), np.float32)
    outs = sess.run(None, feed)
    nxt = outs[0][:, -1].argmax(-1)[:, None].astype(np.int64)
    feed2: dict[str, np.ndarray] = {"input_ids": nxt, "attention_mask": np.concatenate([mask, np.ones((2, 1), np.int64)], 1),
                                    "position_ids": pos[:, -1:] + 1}
    for i in range(n_layers):
        feed2[f"past_key_values.{i}.key"] = outs[1 + 2 * i]
        feed2[f"past_key_values.{i}.value"] = outs[2 + 2 * i]
    outs2 = sess.run(None, feed2)
    del sess
    return outs, outs2, nxt


def validate_decoder(onnx_path: Path, load_model: Callable[[], Any], geometry: dict[str, Any], atol: float,
                     last_only: bool) -> ValidationReport:
    """Run prefill (batch 2, one row left-padded) and one decode step in ORT, then in eager (``load_model()``,
    loaded only once ONNX Runtime has let go of the graph: peak memory is one copy of the weights); compare."""
    import torch
    from transformers.cache_utils import DynamicCache

    rng = np.random.default_rng(0)
    seq, pad = 9, 3
    ids = rng.integers(0, geometry["vocab_size"], size=(2, seq), dtype=np.int64)
    mask = np.ones((2, seq), dtype=np.int64)
    mask[0, :pad] = 0
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    outs, outs2, nxt = _onnx_steps(onnx_path, geometry, ids, mask, pos)
    ort_logits = outs[0][:, -1:] if not last_only else outs[0]

    model = load_model()
    cache = DynamicCache(config=model.config)
    t = torch.from_numpy
    ref_logits, cache = _reference_step(model, t(ids), t(mask), t(pos), cache)
    prefill_diff = float(np.abs(ort_logits - ref_logits).max())
    top1 = bool((ort_logits.argmax(-1) == ref_logits.argmax(-1)).all())
    scale = float(max(1.0, np.abs(ref_logits).max()))

    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    ref2, cache = _reference_step(model, t(nxt), t(mask2), t(pos[:, -1:] + 1), cache)
    del model
    decode_diff = float(np.abs(outs2[0][:, -1:] - ref2).max())
    top1 = top1 and bool((outs2[0][:, -1:].argmax(-1) == ref2.argmax(-1)).all())
    scale = max(scale, float(np.abs(ref2).max()))

    present_diff, present_scale = 0.0, 1.0
    real = mask2.astype(bool)
    for i, layer in enumerate(cache.layers):
        for j, ref_t in enumerate((layer.keys, layer.values)):
            ours = outs2[1 + 2 * i + j]
            ref = ref_t.float().numpy()
            keep = ref.shape[2]  # sliding layers keep only the newest positions
            ours, row_mask = ours[:, :, -keep:], real[:, -keep:]
            diff = np.abs(ours - ref) * row_mask[:, None, :, None]
            present_diff = max(present_diff, float(diff.max()))
            present_scale = max(present_scale, float(np.abs(ref).max()))

    tol = atol * scale
    passed = top1 and max(prefill_diff, decode_diff) <= tol and present_diff <= atol * present_scale
    report = ValidationReport(prefill_diff, decode_diff, present_diff, scale, tol, top1, passed)
    log.debug("validation vs eager: %s", report.to_dict())
    return report
