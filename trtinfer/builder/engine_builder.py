"""``build``: MODEL -> self-contained engine directory (graph, tokenizer, generation config, manifest.json).

The engine is assembled in a temp folder beside the destination and renamed at the end, so an interrupted or
failed build leaves nothing behind.
"""
from __future__ import annotations

import json
import logging
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from trtinfer._cache import atomic_dir
from trtinfer.builder.backends import fused_op_counts, get_build_backend, graph_io, op_histogram
from trtinfer.builder.check import check_engine
from trtinfer.builder.config import BuildConfig
from trtinfer.errors import BuildError
from trtinfer.runtime.manifest import MANIFEST_NAME, MANIFEST_VERSION, Manifest

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def _tokenizer_info(src: Path, out: Path) -> dict[str, Any]:
    """Copy the tokenizer files and record BOS/EOS/PAD the way transformers' ``generate`` will use them."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(src)
    if not (src / "tokenizer.json").is_file():
        tok.save_pretrained(out)  # a slow tokenizer gets converted to tokenizer.json here
    if tok.chat_template and not (src / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(tok.chat_template)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy2(src / name, out / name)
    if not (out / "tokenizer.json").is_file():
        raise BuildError(f"{src} has no fast tokenizer (tokenizer.json) and none could be made; the runtime needs one")
    try:
        gen = GenerationConfig.from_pretrained(src)
        eos = gen.eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tok.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    return {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "bos_token_id": tok.bos_token_id,
            "eos_token_ids": eos_ids, "pad_token_id": pad, "chat_template": bool(tok.chat_template)}


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch
    import transformers

    from trtinfer import __version__

    return {"trtinfer": __version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version()}


def _manifest(config: BuildConfig, info: dict[str, Any], files: dict[str, str], tok_info: dict[str, Any],
              out: Path, max_seq: int, t_start: float) -> dict[str, Any]:
    hist = op_histogram(out / files["decoder"])
    io = graph_io(out / files["decoder"])
    report = json.loads((out / files["fusion_report"]).read_text()) if "fusion_report" in files else {}
    return {
        "manifest_version": MANIFEST_VERSION,
        "backend": config.backend,
        "precision": config.precision,
        "target": config.target,
        "architecture": info["architecture"],
        "model_type": info["model_type"],
        "source": info["source"],
        "limits": {"max_batch_size": config.max_batch_size, "max_seq_len": max_seq},
        "geometry": info["geometry"],
        "io": io,
        "kv_layout": "shared_buffer" if any(t["name"] == "seqlens_k" for t in io["inputs"]) else "concat",
        "files": files,
        "tokenizer": tok_info,
        "export": {"config": info["config"], "seconds": info["export_seconds"], "validation": info["validation"]},
        "build_config": config.to_dict(),
        "op_histogram": hist,
        "fusion_report": report,
        "fused_ops": fused_op_counts(hist, info["geometry"], report),
        "versions": _versions(),
        "build_seconds": round(time.perf_counter() - t_start, 2),
    }


def build(model: str | Path, output_dir: str | Path, config: BuildConfig | None = None, *,
          overwrite: bool = False, progress: bool = True) -> Path:
    """Build an engine for MODEL into ``output_dir``; returns the directory. Exports are cached by content hash."""
    from tqdm.auto import tqdm

    from trtinfer.export.onnx_export import export_cached
    from trtinfer.export.sources import resolve_model

    config = config or BuildConfig()
    backend = get_build_backend(config.backend)
    out = Path(output_dir)
    if out.exists() and not overwrite:
        raise BuildError(f"{out} already exists; choose another -o or pass --force to replace it")
    t_start = time.perf_counter()
    if config.precision != "fp32" and config.target == "cpu":
        log.warning("%s on the CPU provider is for checking numerics: ONNX Runtime's CPU fp16 kernels are ~3x slower "
                    "than fp32 (SmolLM2 decode 12 vs 38 tok/s); build fp32 for CPU, fp16/bf16 for --target cuda",
                    config.precision)
    resolved = resolve_model(model)  # bad MODEL fails here, before any progress output
    from trtinfer.export.encoder import is_encoder

    if is_encoder(resolved.path):
        from trtinfer.builder.encoder_builder import build_encoder

        with atomic_dir(out, overwrite=overwrite) as tmp:
            build_encoder(resolved, tmp, config, t_start)
        log.info("built encoder %s in %.1f s", out, time.perf_counter() - t_start)
        return out
    with tqdm(total=3, desc="export + validate", disable=not progress, unit="step") as steps:
        exported = export_cached(resolved, config.export)
        steps.update()
        info = exported.info
        geo = info["geometry"]
        max_seq = config.max_seq_len_for(geo)
        with atomic_dir(out, overwrite=overwrite) as tmp:
            steps.set_description(f"{config.backend} optimize")
            files = backend(exported, tmp, config)
            steps.update()
            steps.set_description("package")
            manifest = _manifest(config, info, files, _tokenizer_info(resolved.path, tmp), tmp, max_seq, t_start)
            steps.update()
            steps.set_description("check vs export")
            check = check_engine(tmp, Manifest(manifest), exported.onnx_path, config.precision, provider=config.target)
            if not check.passed:
                raise BuildError(f"the built engine's logits differ from the exported graph's by {check.max_abs_diff:.4g} "
                                 f"(> {check.tolerance:g} x {check.logits_scale:.3g}); try --keep-fp32 with more "
                                 "groups, or --disable-pass to find the pass at fault")
            manifest["engine_check"] = check.to_dict()
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
            steps.update()
    log.info("built %s in %.1f s", out, time.perf_counter() - t_start)
    return out
