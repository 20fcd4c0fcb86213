"""Compare an exported decoder graph with PyTorch eager: prefill, then one decode step.

The reference is the unwrapped transformers model with its own masks and cache, so the check covers our
mask construction as well as the trace. Present KV is compared on real (unpadded) positions only, and on the
positions transformers keeps: its sliding layers drop the oldest ones.

The eager model may be cut to the first ``vocab`` tokens of its vocabulary (embedding rows and LM head rows, read
from the same checkpoint tensors): the prompts then use only those tokens and the first ``vocab`` logits are compared.
Every layer runs whole; what is left out are LM head rows, each one more row of the same MatMul. At a 262k
vocabulary (Gemma-3-270M) the fp32 table is 671 of the model's 1,022 MiB.
"""
from __future__ import annotations

import logging
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
    vocab_compared: int
    vocab_size: int

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON."""
        return asdict(self)


def vocab_scope(report: dict[str, Any]) -> str:
    """`` on the first 32768 of 262144 tokens`` where a validation record's eager reference kept a cut vocabulary,
    else ``""`` (also for records written before the cut existed)."""
    cut = report.get("vocab_compared", 0) < report.get("vocab_size", 0)
    return f" on the first {report['vocab_compared']} of {report['vocab_size']} tokens" if cut else ""


def _reference_step(model: Any, ids: Any, mask: Any, pos: Any, cache: Any) -> tuple[np.ndarray, Any]:
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[:, -1:].float().numpy(), out.past_key_values


@dataclass(frozen=True)
class EagerSteps:
    """Eager's side of the comparison (:func:`eager_steps`): the prompts it ran (batch 2, the first row left-padded),
    the greedy token it fed next, the prefill's last logits, the step's logits and each layer's (keys, values)."""

    ids: np.ndarray
    mask: np.ndarray
    pos: np.ndarray
    nxt: np.ndarray
    logits: np.ndarray
    logits2: np.ndarray
    presents: list[tuple[np.ndarray, np.ndarray]]


def validation_inputs(vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, mask, positions)``: 2 rows of 9 random tokens among the first ``vocab`` (seed 0), the first row
    left-padded by 3."""
    rng = np.random.default_rng(0)
    seq, pad = 9, 3
    ids = rng.integers(0, vocab, size=(2, seq), dtype=np.int64)
    mask = np.ones((2, seq), dtype=np.int64)
    mask[0, :pad] = 0
    return ids, mask, np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def _onnx_steps(onnx_path: Path, geometry: dict[str, Any], eager: EagerSteps) -> tuple[list[np.ndarray],
                                                                                      list[np.ndarray]]:
    """Prefill then one decode step on eager's token in ONNX Runtime (eager has let go of its weights: the two never
    hold them at once). Returns both steps' outputs."""
    import onnxruntime as ort

    from trtinfer.runtime.memory import stage_session_options

    so = stage_session_options(onnx_path, always=True)  # a few runs: mapped weights, no packed copy
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    n_layers, kv, hd = geometry["num_layers"], geometry["num_kv_heads"], geometry["head_dim"]
    ids, mask, pos, nxt = eager.ids, eager.mask, eager.pos, eager.nxt
    feed: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    for i in range(n_layers):
        feed[f"past_key_values.{i}.key"] = np.zeros((2, kv, 0, hd), np.float32)
        feed[f"past_key_values.{i}.value"] = np.zeros((2, kv, 0, hd), np.float32)
    outs = sess.run(None, feed)
    feed2: dict[str, np.ndarray] = {"input_ids": nxt, "attention_mask": np.concatenate([mask, np.ones((2, 1), np.int64)], 1),
                                    "position_ids": pos[:, -1:] + 1}
    for i in range(n_layers):
        feed2[f"past_key_values.{i}.key"] = outs[1 + 2 * i]
        feed2[f"past_key_values.{i}.value"] = outs[2 + 2 * i]
    outs2 = sess.run(None, feed2)
    del sess
    return outs, outs2


def eager_steps(path: Path, cut: tuple[int | None, int | None], vocab: int) -> EagerSteps:
    """Eager's side of the comparison (run by the export's child after its trace, :mod:`trtinfer.export.isolated`):
    the model in ``path`` cut to ``cut`` = (layers, vocabulary) (``None``: whole) prefills
    :func:`validation_inputs` of ``vocab``, then one step on its own greedy token among the first ``vocab``."""
    import torch
    from transformers.cache_utils import DynamicCache

    from trtinfer.export.onnx_export import load_hf_config, load_hf_model, reduced_depth
    from trtinfer.export.quiet import quiet_third_party

    t = torch.from_numpy
    ids, mask, pos = validation_inputs(vocab)
    with quiet_third_party():  # the eager model warns about its own past_key_values argument
        model = load_hf_model(path, reduced_depth(load_hf_config(path), *cut))
        cache = DynamicCache(config=model.config)
        ref_logits, cache = _reference_step(model, t(ids), t(mask), t(pos), cache)
        nxt = ref_logits[:, -1, :vocab].argmax(-1)[:, None].astype(np.int64)
        mask2 = np.concatenate([mask, np.ones((ids.shape[0], 1), np.int64)], axis=1)
        ref2, cache = _reference_step(model, t(nxt), t(mask2), t(pos[:, -1:] + 1), cache)
    del model
    presents = [(layer.keys.float().numpy(), layer.values.float().numpy()) for layer in cache.layers]
    from trtinfer.runtime.memory import return_freed_memory

    return_freed_memory()  # in-process (torch already loaded): the model and its activations
    return EagerSteps(ids, mask, pos, nxt, ref_logits, ref2, presents)


def validate_decoder(onnx_path: Path, eager: EagerSteps, geometry: dict[str, Any], atol: float,
                     last_only: bool, vocab: int | None = None) -> ValidationReport:
    """Run eager's prompts and token (:func:`eager_steps`) through the graph in ONNX Runtime, prefill then one decode
    step, and compare. ``vocab``: the eager model has only the first ``vocab`` tokens (see the module docstring)."""
    vocab = min(vocab or geometry["vocab_size"], geometry["vocab_size"])
    mask, presents, ref_logits, ref2 = eager.mask, eager.presents, eager.logits, eager.logits2
    outs, outs2 = _onnx_steps(onnx_path, geometry, eager)
    ort_logits = (outs[0][:, -1:] if not last_only else outs[0])[..., :vocab]
    prefill_diff = float(np.abs(ort_logits - ref_logits).max())
    top1 = bool((ort_logits.argmax(-1) == ref_logits.argmax(-1)).all())
    scale = float(max(1.0, np.abs(ref_logits).max()))

    mask2 = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    ours2 = outs2[0][:, -1:, :vocab]
    decode_diff = float(np.abs(ours2 - ref2).max())
    top1 = top1 and bool((ours2.argmax(-1) == ref2.argmax(-1)).all())
    scale = max(scale, float(np.abs(ref2).max()))

    present_diff, present_scale = 0.0, 1.0
    real = mask2.astype(bool)
    for i, layer in enumerate(presents):
        for j, ref in enumerate(layer):
            ours = outs2[1 + 2 * i + j]
            keep = ref.shape[2]  # sliding layers keep only the newest positions
            ours, row_mask = ours[:, :, -keep:], real[:, -keep:]
            diff = np.abs(ours - ref) * row_mask[:, None, :, None]
            present_diff = max(present_diff, float(diff.max()))
            present_scale = max(present_scale, float(np.abs(ref).max()))

    tol = atol * scale
    passed = top1 and max(prefill_diff, decode_diff) <= tol and present_diff <= atol * present_scale
    report = ValidationReport(prefill_diff, decode_diff, present_diff, scale, tol, top1, passed, int(vocab),
                              int(geometry["vocab_size"]))
    log.debug("validation vs eager: %s", report.to_dict())
    return report
