"""Trace a HF causal LM into one ONNX graph that serves prefill and decode, then validate it against eager."""
from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtinfer._cache import atomic_dir, cached_dir, key_of
from trtinfer.errors import ExportError, ModelSourceError, ValidationError
from trtinfer.export.architectures import spec_for
from trtinfer.export.config import ExportConfig
from trtinfer.export.sources import ResolvedModel, resolve_model

log = logging.getLogger(__name__)

ONNX_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
INFO_NAME = "export.json"
EXPORT_FORMAT = 4  # bump when the graph contract changes (invalidates cached exports)


@dataclass(frozen=True)
class ExportResult:
    """A folder holding ``model.onnx`` (+ external data) and ``export.json`` (geometry, I/O, validation)."""

    path: Path
    info: dict[str, Any]

    @property
    def onnx_path(self) -> Path:
        """The graph file."""
        return self.path / ONNX_NAME


def io_spec(geometry: dict[str, Any], logits_mode: str) -> dict[str, list[dict[str, Any]]]:
    """Names, dtypes and symbolic shapes of the decoder graph's inputs and outputs."""
    kv_in = ["batch", geometry["num_kv_heads"], "past_sequence", geometry["head_dim"]]
    kv_out = ["batch", geometry["num_kv_heads"], "total_sequence", geometry["head_dim"]]
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
        {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "total_sequence"]},
        {"name": "position_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
    ]
    outputs = [
        {"name": "logits", "dtype": "float32",
         "shape": ["batch", 1 if logits_mode == "last" else "sequence", geometry["vocab_size"]]},
    ]
    for i in range(geometry["num_layers"]):
        for kind in ("key", "value"):
            inputs.append({"name": f"past_key_values.{i}.{kind}", "dtype": "float32", "shape": kv_in})
            outputs.append({"name": f"present.{i}.{kind}", "dtype": "float32", "shape": kv_out})
    return {"inputs": inputs, "outputs": outputs}


def load_hf_model(path: Path) -> Any:
    """Load a causal LM in fp32 with eager attention (the form we trace and validate against)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelSourceError(f"cannot read the config in {path}: {e}") from e
    spec_for(config)  # refuse unknown architectures before loading weights
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    except Exception as e:
        raise ModelSourceError(f"cannot load the model in {path}: {e}") from e
    return model.eval()


def _trace(model: Any, geometry: dict[str, Any], mask_mapping: bool, config: ExportConfig, out: Path) -> None:
    import onnx
    import torch

    from trtinfer.export.wrapper import DecoderWithPast, traced_attention

    wrapper = DecoderWithPast(model, geometry, mask_mapping, config.logits == "last").eval()
    b, s, p = 2, 7, 5  # distinct sizes so no dimension is mistaken for another
    kv, hd = geometry["num_kv_heads"], geometry["head_dim"]
    ids = torch.randint(0, geometry["vocab_size"], (b, s))
    mask = torch.ones(b, p + s, dtype=torch.int64)
    mask[0, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, p:]
    past = [torch.randn(b, kv, p, hd) for _ in range(2 * geometry["num_layers"])]
    spec = io_spec(geometry, config.logits)
    names_in = [t["name"] for t in spec["inputs"]]
    names_out = [t["name"] for t in spec["outputs"]]
    dyn = {
        t["name"]: {i: d for i, d in enumerate(t["shape"]) if isinstance(d, str)}
        for t in spec["inputs"] + spec["outputs"]
    }
    raw = out / "raw"
    raw.mkdir()
    with torch.no_grad(), traced_attention(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper, (ids, mask, pos, *past), str(raw / ONNX_NAME), input_names=names_in, output_names=names_out,
            dynamic_axes=dyn, opset_version=config.opset, do_constant_folding=True, dynamo=False,
        )
    proto = onnx.load(str(raw / ONNX_NAME), load_external_data=True)
    # the passes read their expectations (layers, norms, windows) from here when run on the file alone
    onnx.helper.set_model_props(proto, {"trtinfer.geometry": json.dumps(geometry)})
    onnx.save_model(proto, str(out / ONNX_NAME), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_NAME, size_threshold=1024)
    for f in raw.iterdir():
        f.unlink()
    raw.rmdir()


def export(model: str | Path | ResolvedModel, output_dir: str | Path, config: ExportConfig | None = None,
           *, overwrite: bool = False) -> ExportResult:
    """Export MODEL to ``output_dir`` (``model.onnx``, ``model.onnx.data``, ``export.json``) and validate it.

    Raises :class:`ValidationError` if ONNX Runtime and eager disagree beyond ``config.atol`` (scaled by the
    logits' magnitude) or on any top-1 token; nothing is left at ``output_dir`` then.
    """
    config = config or ExportConfig()
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    hf = load_hf_model(resolved.path)
    spec = spec_for(hf.config)
    geometry = spec.geometry(hf.config)
    with atomic_dir(Path(output_dir), overwrite=overwrite) as tmp:
        t0 = time.perf_counter()
        try:
            _trace(hf, geometry, spec.mask_mapping, config, tmp)
        except Exception as e:
            raise ExportError(f"tracing {spec.name} to ONNX failed: {type(e).__name__}: {e}") from e
        export_s = time.perf_counter() - t0
        log.info("exported %s (%d layers) in %.1f s", spec.name, geometry["num_layers"], export_s)
        info: dict[str, Any] = {
            "format": EXPORT_FORMAT,
            "architecture": spec.name,
            "model_type": hf.config.model_type,
            "source": {"path": str(resolved.path), "model": resolved.source, "sha256": resolved.sha256,
                       "kind": resolved.kind},
            "config": config.to_dict(),
            "geometry": geometry,
            "io": io_spec(geometry, config.logits),
            "export_seconds": round(export_s, 2),
            "validation": None,
        }
        if config.validate:
            from trtinfer.export.validate import validate_decoder

            report = validate_decoder(tmp / ONNX_NAME, hf, geometry, config.atol, config.logits == "last")
            info["validation"] = report.to_dict()
            if not report.passed:
                raise ValidationError(
                    f"exported graph disagrees with eager: logits diff {report.prefill_logits_max_abs_diff:.2e}/"
                    f"{report.decode_logits_max_abs_diff:.2e} (tolerance {report.tolerance:.2e}), present diff "
                    f"{report.present_max_abs_diff:.2e}, top-1 agree {report.top1_agree}; raise --atol only if "
                    "these are fp32 reordering noise"
                )
        (tmp / INFO_NAME).write_text(json.dumps(info, indent=2))
    return ExportResult(Path(output_dir), info)


def export_cached(model: str | Path | ResolvedModel, config: ExportConfig | None = None) -> ExportResult:
    """Like :func:`export`, into ``~/.cache/trtinfer/onnx/<hash of source, config, versions>``, reused if there."""
    import torch
    import transformers

    config = config or ExportConfig()
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    key = key_of([EXPORT_FORMAT, resolved.sha256, config.to_dict(), torch.__version__, transformers.__version__])

    def make(tmp: Path) -> None:
        export(resolved, tmp / "export", config)
        for f in (tmp / "export").iterdir():
            f.rename(tmp / f.name)
        (tmp / "export").rmdir()

    path = cached_dir("onnx", key, make)
    return ExportResult(path, json.loads((path / INFO_NAME).read_text()))
