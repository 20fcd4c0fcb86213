"""Trace a HF causal LM into one ONNX graph that serves prefill and decode, validate it against eager, and write
the export stage directory (:mod:`trtinfer.stages`)."""
from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

from trtinfer._cache import key_of
from trtinfer.artifact import DATA_NAME, ONNX_NAME, REFERENCE_NAME, StageDir, write_stage
from trtinfer.checkpoint import Checkpoint
from trtinfer.errors import ExportError, ModelSourceError, TrtInferError, ValidationError
from trtinfer.export import isolated
from trtinfer.export.architectures import spec_for
from trtinfer.export.config import ExportConfig
from trtinfer.export.reference import write_reference
from trtinfer.export.sources import ResolvedModel, resolve_model
from trtinfer.export.tokenizer import save_tokenizer
from trtinfer.export.validate import EagerSteps, eager_steps
from trtinfer.stages import cached_stage, make_stage, package_versions

log = logging.getLogger(__name__)

# Bump when the graph contract changes. 7: streamed, stage.json "weights"; 8: weights left in the checkpoint;
# 9: weights[*].gguf (each weight's GGUF origin)
EXPORT_FORMAT = 9
ExportResult = StageDir  # what :func:`export` returns: the stage directory it wrote


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


def check_model_type(path: Path) -> bool:
    """Refuse a ``config.json`` without a model_type or of an architecture that does not export (torch-free: before
    transformers, whose own refusal of a type it does not know is several paragraphs); False when there is no
    readable ``config.json`` (transformers then says what is wrong with it)."""
    import json
    from types import SimpleNamespace

    try:
        said = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(said, dict):
        return False
    if not isinstance(said.get("model_type"), str):
        raise ModelSourceError(f"{Path(path) / 'config.json'} has no model_type (a string such as \"llama\"); "
                               "re-download the model's config.json")
    spec_for(SimpleNamespace(model_type=said["model_type"]))
    return True


def load_hf_config(path: Path) -> Any:
    """The model's transformers config; unknown architectures are refused here, before any weight is read."""
    from transformers import AutoConfig

    check_model_type(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelSourceError(f"cannot read the config in {path}: {e}") from e
    spec_for(config)
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelSourceError(f"{Path(path) / 'config.json'} says {name} {value!r}: a model needs at least 1; "
                                   "re-download the model's config.json")
    return config


def reduced_depth(hf_config: Any, layers: int | None, vocab: int | None = None) -> Any:
    """``hf_config`` with only its first ``layers`` decoder layers (per-layer lists cut to match) and its first
    ``vocab`` tokens (no padding token past them); as is when both are None."""
    import copy

    cut_layers = layers is not None and layers < hf_config.num_hidden_layers
    cut_vocab = vocab is not None and vocab < hf_config.vocab_size
    if not cut_layers and not cut_vocab:
        return hf_config
    cut = copy.deepcopy(hf_config)
    if cut_layers:
        cut.num_hidden_layers = layers
        if isinstance(getattr(cut, "layer_types", None), list):
            cut.layer_types = cut.layer_types[:layers]
    if cut_vocab:
        cut.vocab_size = vocab
        if isinstance(pad := getattr(cut, "pad_token_id", None), int) and pad >= cut.vocab_size:
            cut.pad_token_id = None  # an embedding's padding row must exist (a GGUF's config names Qwen3's 151643)
    return cut


def load_hf_model(path: Path, config: Any = None) -> Any:
    """A causal LM in fp32 with eager attention, its parameters read from the checkpoint in ``path`` by the export's
    own reader (the same bytes the graph was given): the reference the export is validated against, made only
    where it fits in memory. ``config``: the model's (default) or a :func:`reduced_depth` one, whose parameters
    take their leading rows and layers from the same checkpoint tensors."""
    import torch
    from accelerate.utils import set_module_tensor_to_device

    from trtinfer.export.streamed import WRAPPER_PREFIX, SourceReader, empty_model

    config = config if config is not None else load_hf_config(path)
    try:
        model = empty_model(config)  # no random initialization: each parameter is allocated once, then filled
        reader = SourceReader(model, Checkpoint(path), row_prefix=True)
        for name, p in list(model.named_parameters()):  # tied parameters once
            value = torch.empty(tuple(p.shape), dtype=torch.float32)
            reader.fill(WRAPPER_PREFIX + name, value.numpy())  # straight into the parameter, block by block
            set_module_tensor_to_device(model, name, "cpu", value=value)
        model.tie_weights()
    except TrtInferError:
        raise
    except Exception as e:
        raise ModelSourceError(f"cannot load the model in {path}: {e}") from e
    return model.eval()


#: the eager reference's vocabulary: its first tokens' embedding and LM head rows (validate.py's docstring)
VALIDATION_VOCAB = 32768


def validation_vocab(hf_config: Any) -> int:
    """How many leading tokens the eager reference keeps: :data:`VALIDATION_VOCAB`, or the whole vocabulary where
    it is smaller or a special token id lies beyond the cut (an embedding's padding row must exist)."""
    vocab = int(hf_config.vocab_size)
    special = [getattr(hf_config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")]
    ids = [i for s in special for i in (s if isinstance(s, list) else [s]) if isinstance(i, int)]
    return vocab if vocab <= VALIDATION_VOCAB or any(i >= VALIDATION_VOCAB for i in ids) else VALIDATION_VOCAB


def eager_fits(fp32_bytes: int) -> tuple[bool, str]:
    """Whether an fp32 eager copy of the model fits in the share of available memory a graph may take
    (:func:`~trtinfer.runtime.memory.fits_in_memory`), and the figures."""
    from trtinfer.runtime.memory import available_memory, fits_in_memory

    avail = available_memory()
    if avail is None:
        return True, "memory unknown"
    return fits_in_memory(fp32_bytes), f"fp32 eager needs {fp32_bytes / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"


def _trace(model: Any, ckpt: Checkpoint, geometry: dict[str, Any], mask_mapping: bool, config: ExportConfig,
           out: Path) -> dict[str, dict[str, Any]]:
    """Trace ``model`` (:func:`streamed.empty_model`) with its weights as inputs, left in ``ckpt`` by reference.

    Returns where each initializer came from: ``{name: {"tensor": checkpoint tensor, "ops": [folded op types]}}``.
    """
    import onnx
    import torch

    from trtinfer.export.streamed import (
        SourceReader,
        attach_weights,
        drop_wrapper_scope,
        fold_weight_chains,
        refer_weights,
        weights_as_inputs,
        write_weights,
    )
    from trtinfer.export.wrapper import DecoderWithPast, traced_attention

    wrapper = DecoderWithPast(model, geometry, mask_mapping, config.logits == "last").eval()
    reader = SourceReader(wrapper.model, ckpt, row_prefix=config.vocab is not None)  # before the parameters go
    traced, weight_names, weights = weights_as_inputs(wrapper)
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
    raw = out / "raw.onnx"
    with torch.no_grad(), traced_attention(model), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            traced, (ids, mask, pos, *past, *weights), str(raw), input_names=names_in + weight_names,
            output_names=names_out, dynamic_axes=dyn, opset_version=config.opset, do_constant_folding=True,
            dynamo=False,
        )
    proto = onnx.load(str(raw))  # the graph without weights: small whatever the model's size
    raw.unlink()
    drop_wrapper_scope(proto)
    sources = fold_weight_chains(proto, set(weight_names))
    read = [src for src in sources if not src.nodes or src.transposed_2d]  # stay in the checkpoint
    computed = [src for src in sources if src not in read]
    if computed:
        attach_weights(proto, write_weights(computed, reader, out / DATA_NAME), DATA_NAME)
    from trtinfer.stage_weights import CHECKPOINT_KEY

    # the passes read their expectations (layers, norms, windows) from here when run on the file alone
    onnx.helper.set_model_props(proto, {"trtinfer.geometry": json.dumps(geometry),
                                        CHECKPOINT_KEY: refer_weights(proto, read, reader)})
    onnx.save_model(proto, str(out / ONNX_NAME))
    return {src.graph_name: {"tensor": reader.tensor(src.source), "ops": src.op_types} for src in sources}


def _validate(graph: Path, eager: EagerSteps, vocab: int, geometry: dict[str, Any],
              config: ExportConfig) -> dict[str, Any]:
    """Compare ``graph`` with the eager model's steps (the trace's child ran them); raises on failure."""
    from trtinfer.export.validate import validate_decoder, vocab_scope

    report = validate_decoder(graph, eager, geometry, config.atol, config.logits == "last", vocab)
    if not report.passed:
        raise ValidationError(
            f"exported graph disagrees with eager: logits diff {report.prefill_logits_max_abs_diff:.2e}/"
            f"{report.decode_logits_max_abs_diff:.2e} (tolerance {report.tolerance:.2e}), present diff "
            f"{report.present_max_abs_diff:.2e}, top-1 agree {report.top1_agree}; raise --atol only if "
            "these are fp32 reordering noise"
        )
    record = report.to_dict()
    log.info("validated against PyTorch eager: logits max|diff| %.2e (tolerance %.2e)%s, top-1 agrees",
             max(report.prefill_logits_max_abs_diff, report.decode_logits_max_abs_diff), report.tolerance,
             vocab_scope(record))
    return record


def _traced(resolved: ResolvedModel, folder: Path, config: ExportConfig) -> dict[str, Any]:
    """The torch and transformers half of an export (a child's work: :mod:`trtinfer.export.isolated`): trace the
    graph into ``folder`` (weights left in the checkpoint), save the tokenizer; returns what the rest needs to know
    of the model (its weight records, geometry, architecture, model type, the eager reference's
    vocabulary), the trace's seconds and the tokenizer record; and whether eager and a whole fp32 copy of the graph
    fit (``fits``, ``runnable``: each with its figures) and, where both do and ``config.validate``, eager's side of
    the validation (``eager``), run here: one child's start-up (torch and transformers: ~4 s) instead of two."""
    from trtinfer.export.streamed import empty_model

    hf_config = reduced_depth(load_hf_config(resolved.path), config.layers, config.vocab)
    ckpt = Checkpoint(resolved.path)  # a missing shard or truncated tensor fails here, before the trace
    spec = spec_for(hf_config)
    geometry = spec.geometry(hf_config)
    tokenizer = save_tokenizer(resolved.path, folder)  # a broken tokenizer fails here too, before the trace
    t0 = time.perf_counter()
    model = empty_model(hf_config)
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())  # meta tensors: sizes only
    try:
        weights = _trace(model, ckpt, geometry, spec.mask_mapping, config, folder)
    except TrtInferError:
        raise
    except Exception as e:
        raise ExportError(f"tracing {spec.name} to ONNX failed: {type(e).__name__}: {e}") from e
    del model
    export_s = time.perf_counter() - t0
    log.info("traced %s (%d layers) to ONNX in %.1f s", spec.name, geometry["num_layers"], export_s)
    from trtinfer.runtime.memory import return_freed_memory

    # where this runs in the build's own process (torch already loaded there): the trace and transformers' tokenizer
    # loading (262k entries for Gemma-3) leave hundreds of MB freed but held by the allocator
    return_freed_memory()
    from trtinfer.runtime.memory import whole_copy_fits
    from trtinfer.stage_weights import graph_weight_bytes

    vocab = validation_vocab(hf_config)
    runnable = whole_copy_fits(graph_weight_bytes(folder / ONNX_NAME), folder)
    fits = eager_fits(fp32_bytes)
    eager = None
    if config.validate and fits[0] and runnable[0]:  # (the layers and vocabulary cut as this export's; vocab <= its own)
        eager = eager_steps(resolved.path, (config.layers, vocab), min(vocab, geometry["vocab_size"]))
    return {"weights": weights, "seconds": export_s, "geometry": geometry,
            "architecture": spec.name, "model_type": hf_config.model_type, "validation_vocab": vocab,
            "tokenizer": tokenizer, "fits": fits, "runnable": runnable, "eager": eager}


def _export_into(resolved: ResolvedModel, folder: Path, config: ExportConfig) -> StageDir:
    """Trace (in a child: :mod:`trtinfer.export.isolated`), validate and write the export stage into the existing
    empty ``folder``."""
    if check_model_type(resolved.path):  # a wrong config or damaged checkpoint fails now, not after the child's
        Checkpoint(resolved.path)  # seconds of importing torch (a config that does not read: the child says why)
    traced = isolated.run(_traced, resolved, folder, config)  # transformers and torch stay out of this process
    weights, export_s, geometry = (traced[k] for k in ("weights", "seconds", "geometry"))
    import onnx

    from trtinfer.stage_weights import CHECKPOINT_COUNT, checkpoint_inputs, materialized_file

    (runnable, run_figures), (fits, figures) = traced["runnable"], traced["fits"]
    validation, skipped = None, {}
    if config.validate and not (fits and runnable):
        skipped["validation"] = f"eager does not fit: {figures}" if not fits else f"does not fit: {run_figures}"
        log.warning("the export is not compared with PyTorch eager (%s)", figures if not fits else run_figures)
    if config.logits == "last" and not runnable:
        skipped["reference"] = f"the fp32 graph does not fit: {run_figures}"
        log.warning("no engine-check reference is computed (%s): engines built from it are not checked", run_figures)
    from trtinfer.export.gguf_convert import gguf_origins

    origins = gguf_origins(resolved.path)  # a converted GGUF: which GGUF tensor each weight came from
    for entry in weights.values():
        if entry["tensor"] in origins:
            entry["gguf"] = origins[entry["tensor"]]
    eager = traced["eager"]  # eager's side of the validation: there when the child found that it runs (and fits)
    if eager is not None or runnable and config.logits == "last":
        from trtinfer.passes.embedding import share_tied_embedding

        # ONNX Runtime reads weights from files only: a whole copy, its tied embedding stored once as in an engine
        vocab = int(geometry["vocab_size"])
        with materialized_file(folder / ONNX_NAME, lambda m: share_tied_embedding(m, vocab)) as whole:
            if eager is not None:
                validation = _validate(whole, eager, traced["validation_vocab"], geometry, config)
            if config.logits == "last":  # the engine check compares last-position logits
                write_reference(whole, folder / REFERENCE_NAME, geometry["vocab_size"])
    info: dict[str, Any] = {
        "stage": "export",
        "kind": "decoder",
        "architecture": traced["architecture"],
        "model_type": traced["model_type"],
        "source": {"path": str(resolved.path), "model": resolved.source, "sha256": resolved.sha256,
                   "kind": resolved.kind},
        "geometry": geometry,
        "io": io_spec(geometry, config.logits),
        "kv_layout": "concat",
        "tokenizer": traced["tokenizer"],
        "weights": weights,
        CHECKPOINT_COUNT: len(checkpoint_inputs(onnx.load(str(folder / ONNX_NAME), load_external_data=False))),
        "history": {"export": {"config": config.to_dict(), "seconds": round(export_s, 2), "validation": validation,
                               **{f"{k}_skipped": why for k, why in skipped.items()},
                               "format": EXPORT_FORMAT, "versions": stack_versions()}},
    }
    return write_stage(folder, info)


def export(model: str | Path | ResolvedModel, output_dir: str | Path, config: ExportConfig | None = None,
           *, overwrite: bool = False) -> StageDir:
    """Export MODEL to the stage directory ``output_dir`` and validate it against eager.

    ``output_dir`` receives ``model.onnx`` (+ ``model.onnx.data``), the tokenizer files, ``reference.npz`` and
    ``stage.json`` (see :mod:`trtinfer.stages`); ``trtinfer optimize`` and ``trtinfer build`` take it as input.
    Raises :class:`ValidationError` if ONNX Runtime and eager disagree beyond ``config.atol`` (scaled by the
    logits' magnitude) or on any top-1 token; nothing is left at ``output_dir`` then.
    """
    config = config or ExportConfig()
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    return make_stage(output_dir, lambda tmp: _export_into(resolved, tmp, config), overwrite=overwrite,
                      source=resolved.path)


def stack_versions() -> dict[str, str]:
    """Versions of the packages an export depends on (read from metadata: nothing heavy is imported)."""
    return package_versions("torch", "transformers", "onnx")


def export_cached(model: str | Path | ResolvedModel, config: ExportConfig | None = None, *,
                  stats: dict[str, Any] | None = None) -> StageDir:
    """Like :func:`export`, into ``~/.cache/trtinfer/onnx/<hash of source, config, versions>``, reused if there.

    The cache checks the entry's files against their record before reuse, so a damaged export is made again.
    ``stats["cached"]`` tells whether the entry was reused.
    """
    config = config or ExportConfig()
    resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)
    from trtinfer.export.sources import MODELS_FORMAT

    # a GGUF's digest names the file, not the folder made from it: its conversion format is part of the key
    source = [resolved.sha256, MODELS_FORMAT if resolved.kind != "folder" else None]
    key = key_of([EXPORT_FORMAT, source, config.to_dict(), stack_versions()])
    return cached_stage("onnx", key, lambda tmp: _export_into(resolved, tmp, config), stats)
