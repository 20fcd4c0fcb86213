"""``build`` for encoders: fused ONNX Runtime graph + tokenizer + pooling config + manifest (``kind: encoder``).

Fusions come from ``onnxruntime.transformers``' BERT optimizer (Attention, SkipLayerNormalization,
EmbedLayerNormalization, BiasGelu); the fused graph is checked against the unfused one before it is kept.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from trtinfer.artifact import DATA_NAME, new_manifest, write_manifest
from trtinfer.builder.config import BuildConfig
from trtinfer.errors import BuildError, ConfigError
from trtinfer.export.encoder import ENCODER_TYPES, export_encoder_cached
from trtinfer.export.sources import ResolvedModel
from trtinfer.passes.report import FusionReport, PassRecord

log = logging.getLogger(__name__)

_FAMILIES = {
    "attention": ("Attention", "MultiHeadAttention"),
    "norm": ("LayerNormalization", "SkipLayerNormalization", "EmbedLayerNormalization", "SimplifiedLayerNormalization"),
    "gelu": ("Gelu", "BiasGelu", "FastGelu"),
}


def _pooling(src: Path) -> dict[str, Any]:
    """Pooling and normalization as sentence-transformers configures them (mean pooling if unspecified)."""
    pooling = {"mode": "mean", "normalize": False, "max_seq_length": None}
    modules = src / "modules.json"
    if modules.is_file():
        for m in json.loads(modules.read_text()):
            kind = m.get("type", "")
            if kind.endswith("Pooling") and (src / m["path"] / "config.json").is_file():
                cfg = json.loads((src / m["path"] / "config.json").read_text())
                pooling["mode"] = "cls" if cfg.get("pooling_mode_cls_token") else "mean"
            if kind.endswith("Normalize"):
                pooling["normalize"] = True
    sbert = src / "sentence_bert_config.json"
    if sbert.is_file():
        pooling["max_seq_length"] = json.loads(sbert.read_text()).get("max_seq_length")
    return pooling


def _fuse(src: Path, dst: Path, geo: dict[str, Any], model_type: str) -> FusionReport:
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    t0 = time.perf_counter()
    fused = optimize_model(str(src), model_type=ENCODER_TYPES[model_type], num_heads=geo["num_attention_heads"],
                           hidden_size=geo["hidden_size"], opt_level=0)
    stats = fused.get_fused_operator_statistics()
    before = len(onnx.load(str(src), load_external_data=False).graph.node)
    fused.save_model_to_file(str(dst), use_external_data_format=True, all_tensors_to_one_file=True)
    report = FusionReport("onnxruntime-cpu", nodes_before=before, nodes_after=len(fused.model.graph.node))
    n = geo["num_layers"]
    expected = {"attention": n, "norm": geo["num_norms"], "gelu": n}
    secs = time.perf_counter() - t0
    for fam, ops in _FAMILIES.items():
        report.add(PassRecord(fam, "fusion", sum(stats.get(o, 0) for o in ops), expected[fam], secs))
    return report


def _check(unfused: Path, fused: Path) -> float:
    """Max |diff| of last_hidden_state between the two graphs on a padded batch (real positions only)."""
    import numpy as np
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 2000, (2, 11)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    a = ort.InferenceSession(str(unfused), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    b = ort.InferenceSession(str(fused), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return float(np.abs(a - b)[mask.astype(bool)].max())


def build_encoder(resolved: ResolvedModel, out: Path, config: BuildConfig, t_start: float) -> None:
    """Fill ``out`` (a temp dir the caller renames) with the encoder engine."""
    from transformers import AutoTokenizer

    from trtinfer.builder.backends import op_histogram
    from trtinfer.builder.engine_builder import engine_versions
    from trtinfer.stages import graph_io

    if config.backend != "onnxruntime":
        raise BuildError(f"encoders build for the onnxruntime backend only, not '{config.backend}'")
    # what an encoder build does not do is refused, not ignored (the manifest would record settings never used)
    ignored = {"precision": config.precision != "fp32", "prefill": config.prefill is not None,
               "disable_passes": bool(config.disable_passes), "keep_io_types": config.keep_io_types}
    for name in (n for n, given in ignored.items() if given):
        raise ConfigError(f"an encoder engine is the fp32 graph with its fusions; {name.replace('_', ' ')} "
                          f"({getattr(config, name)!r}) applies to decoder builds: drop it", field=name)
    exported = export_encoder_cached(resolved, config.export.atol)
    info, geo = exported.info, exported.geometry
    report = _fuse(exported.onnx_path, out / "model.onnx", geo, info["model_type"])
    diff = _check(exported.onnx_path, out / "model.onnx")
    if diff > 1e-3:
        raise BuildError(f"the fused encoder graph differs from the unfused one by {diff:.2e}: a fusion is wrong for "
                         "this model; please report it with the model's config.json")
    (out / "fusion_report.json").write_text(json.dumps(report.to_dict(), indent=2))
    tok = AutoTokenizer.from_pretrained(resolved.path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (resolved.path / name).is_file():
            shutil.copy2(resolved.path / name, out / name)
    if not (out / "tokenizer.json").is_file():
        tok.save_pretrained(out)
    pooling = _pooling(resolved.path)
    max_seq = min(pooling["max_seq_length"] or geo["max_position_embeddings"], geo["max_position_embeddings"])
    if config.max_seq_len:
        max_seq = min(max_seq, config.max_seq_len)
    hist = op_histogram(out / "model.onnx")
    manifest = new_manifest(
        exported, kind="encoder", backend="onnxruntime", precision="fp32", target=config.target,
        max_batch_size=config.max_batch_size, max_seq_len=max_seq, io=graph_io(out / "model.onnx"),
        files={"encoder": "model.onnx", "encoder_data": DATA_NAME, "fusion_report": "fusion_report.json"},
        tokenizer={"pad_token_id": tok.pad_token_id or 0, "cls_token": tok.cls_token, "sep_token": tok.sep_token},
        pooling=pooling, export={k: exported.history["export"].get(k) for k in ("config", "seconds", "validation")},
        build_config=config.to_dict(), op_histogram=hist, fusion_report=report.to_dict(),
        fused_ops={r.name: {"count": r.fired, "expected": r.expected} for r in report.passes},
        fused_vs_unfused_max_abs_diff=diff, versions=engine_versions(),
        build_seconds=round(time.perf_counter() - t_start, 2))
    write_manifest(out, manifest)
    for w in report.warnings:
        log.warning("%s", w)
