"""Encoders (BERT family) for feature extraction: ``input_ids, attention_mask, token_type_ids -> last_hidden_state``.

Exported with the TorchScript exporter (eager attention, dynamic batch and sequence), validated against eager, and
cached by content hash like decoder exports. Pooling (mean / CLS, L2 normalization) stays outside the graph and is
read from the sentence-transformers files next to the model, so one export serves any pooling.
"""
from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

from trtinfer._cache import key_of
from trtinfer.artifact import DATA_NAME, ONNX_NAME, StageDir, write_stage
from trtinfer.errors import ExportError, ModelSourceError, ValidationError
from trtinfer.export.sources import ResolvedModel
from trtinfer.stages import cached_stage

log = logging.getLogger(__name__)

#: model_type -> the ORT transformers optimizer's model_type for its fusions
ENCODER_TYPES: dict[str, str] = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert"}
ENCODER_FORMAT = 2


def model_type_of(path: Path) -> str | None:
    """``model_type`` from a HF folder's config.json (None if unreadable)."""
    try:
        return str(json.loads((path / "config.json").read_text()).get("model_type"))
    except (OSError, ValueError):
        return None


def is_encoder(path: Path) -> bool:
    """True if the folder holds a registered encoder architecture."""
    return model_type_of(path) in ENCODER_TYPES


def encoder_geometry(config: Any) -> dict[str, Any]:
    """Layers, heads, hidden size and positions; what the fusion report expects."""
    n = int(config.num_hidden_layers)
    return {"num_layers": n, "num_attention_heads": int(config.num_attention_heads),
            "hidden_size": int(config.hidden_size), "max_position_embeddings": int(config.max_position_embeddings),
            "type_vocab_size": int(getattr(config, "type_vocab_size", 0) or 0), "vocab_size": int(config.vocab_size),
            "num_norms": 2 * n + 1}


def _io(geo: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    ins = [{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]}
           for n in ("input_ids", "attention_mask", "token_type_ids")]
    return {"inputs": ins, "outputs": [{"name": "last_hidden_state", "dtype": "float32",
                                        "shape": ["batch", "sequence", geo["hidden_size"]]}]}


def _export(resolved: ResolvedModel, out: Path, atol: float) -> dict[str, Any]:
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch
    from transformers import AutoModel

    try:
        model = AutoModel.from_pretrained(resolved.path, dtype=torch.float32, attn_implementation="eager").eval()
    except Exception as e:
        raise ModelSourceError(f"cannot load the encoder in {resolved.path}: {e}") from e
    geo = encoder_geometry(model.config)

    class Positional(torch.nn.Module):
        """(input_ids, attention_mask, token_type_ids) -> last_hidden_state, for the tracer."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model  # a submodule, so weights keep their names in the graph

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    b, s = 2, 9
    ids = torch.randint(100, min(geo["vocab_size"], 1000), (b, s))
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[1, 6:] = 0
    types = torch.zeros(b, s, dtype=torch.int64)
    dyn = {n: {0: "batch", 1: "sequence"} for n in ("input_ids", "attention_mask", "token_type_ids",
                                                    "last_hidden_state")}
    t0 = time.perf_counter()
    raw = out / "raw"
    raw.mkdir()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(Positional().eval(), (ids, mask, types), str(raw / ONNX_NAME),
                              input_names=["input_ids", "attention_mask", "token_type_ids"],
                              output_names=["last_hidden_state"], dynamic_axes=dyn, opset_version=17,
                              do_constant_folding=True, dynamo=False)
    except Exception as e:
        raise ExportError(f"tracing the encoder failed: {type(e).__name__}: {e}") from e
    proto = onnx.load(str(raw / ONNX_NAME), load_external_data=True)
    onnx.helper.set_model_props(proto, {"trtinfer.geometry": json.dumps(geo)})
    onnx.save_model(proto, str(out / ONNX_NAME), save_as_external_data=True, location=DATA_NAME, size_threshold=1024)
    for f in raw.iterdir():
        f.unlink()
    raw.rmdir()
    export_s = time.perf_counter() - t0
    # validate at a size other than the traced one, with padding
    b, s = 3, 17
    ids = torch.randint(100, min(geo["vocab_size"], 1000), (b, s))
    mask = torch.ones(b, s, dtype=torch.int64)
    mask[0, 10:] = 0
    mask[2, 3:] = 0
    types = torch.zeros(b, s, dtype=torch.int64)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state.numpy()
    sess = ort.InferenceSession(str(out / ONNX_NAME), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": types.numpy()})[0]
    keep = mask.numpy().astype(bool)  # padded positions are don't-care
    diff = float(np.abs(got - ref)[keep].max())
    tol = atol * max(1.0, float(np.abs(ref).max()))
    if diff > tol:
        raise ValidationError(f"exported encoder disagrees with eager: max|diff| {diff:.2e} > {tol:.2e}")
    return {"stage": "export", "kind": "encoder", "architecture": model.config.model_type,
            "model_type": model.config.model_type,
            "source": {"path": str(resolved.path), "model": resolved.source, "sha256": resolved.sha256,
                       "kind": resolved.kind},
            "geometry": geo, "io": _io(geo),
            "history": {"export": {"config": {"opset": 17, "atol": atol}, "seconds": round(export_s, 2),
                                   "format": ENCODER_FORMAT,
                                   "validation": {"max_abs_diff": diff, "tolerance": tol, "passed": True}}}}


def export_encoder_cached(resolved: ResolvedModel, atol: float = 1e-4) -> StageDir:
    """Export and validate the encoder into the stage directory ``~/.cache/trtinfer/onnx/<hash>``, reused when there."""
    from trtinfer.export.onnx_export import stack_versions

    key = key_of(["encoder", ENCODER_FORMAT, resolved.sha256, atol, stack_versions()])
    return cached_stage("onnx", key, lambda tmp: write_stage(tmp, _export(resolved, tmp, atol)))
