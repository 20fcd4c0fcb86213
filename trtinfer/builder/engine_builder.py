"""``build``: MODEL or stage directory -> self-contained engine directory (graph, tokenizer, manifest.json).

The stages chain: export (cached by the model's content hash; its weights stay in the checkpoint) -> optimize for
the backend's pass target (cached by the export's content and the pass config) -> quantize (cached; the one stage
that writes weights before the engine) -> backend compilation plus the engine check, written straight into the
engine directory (not cached: a second copy of a multi-GB engine would double the build's disk). A stage given as
input (``trtinfer export -o X``, ``trtinfer optimize X -o Y``) is verified against its record and used as is.
Cache entries are checked before reuse. The engine is assembled in a temp folder beside the destination and renamed
at the end: a failed or interrupted build leaves nothing behind.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

from trtinfer._outputs import atomic_dir, check_output_dir
from trtinfer.artifact import Manifest, StageDir, is_stage_dir, new_manifest, read_stage, write_manifest
from trtinfer.builder.backends import BuildBackend, fused_op_counts, get_build_backend, op_histogram
from trtinfer.builder.check import EngineCheck, check_accuracy, check_engine
from trtinfer.builder.config import BuildConfig
from trtinfer.builder.progress import StageProgress
from trtinfer.errors import BuildError, ConfigError, InputError
from trtinfer.export.sources import ResolvedModel
from trtinfer.stages import TOKENIZER_FILES, graph_io, package_versions

log = logging.getLogger(__name__)



def engine_versions() -> dict[str, str]:
    """Versions that matter to an engine (from package metadata: nothing heavy is imported)."""
    return {**package_versions("onnxruntime", "onnx"), "python": platform.python_version()}


def _manifest(config: BuildConfig, stage: StageDir, files: dict[str, str], engine: Path, max_seq: int) -> Manifest:
    """The engine's manifest: the stage's model facts, unchanged, plus what the build made."""
    graph = engine / files.get("network", files["decoder"])  # TensorRT: the plan's source graph, weights left out
    hist = op_histogram(graph)
    history = stage.history
    report = history.get("optimize", {}).get("fusion_report", {})
    export = history.get("export", {})
    return new_manifest(
        stage, kind="decoder", backend=config.backend, precision=config.precision, target=config.target,
        max_batch_size=config.max_batch_size, max_seq_len=max_seq, io=graph_io(graph), kv_layout=stage.kv_layout,
        files=files, tokenizer=stage.tokenizer_info,
        export={"config": export.get("config"), "seconds": export.get("seconds"),
                "validation": export.get("validation"),
                **{k: export[k] for k in ("validation_skipped", "reference_skipped") if export.get(k)}},
        build_config={**config.to_dict(), **({"quantization": history["quantize"]["config"]} if "quantize" in history
                                              else {})},  # what the weights were quantized with
        op_histogram=hist, fusion_report=report,
        fused_ops=fused_op_counts(hist, stage.geometry, report), versions=engine_versions(),
        quantization=({k: history["quantize"][k] for k in ("config", "target", "report", "accuracy")}
                      if "quantize" in history else None),
        **({"tensorrt": json.loads((engine / files["tensorrt"]).read_text())} if "tensorrt" in files else {}),
    )


def _from_stage(stage: StageDir, config: BuildConfig) -> tuple[BuildConfig, int]:
    """Check the build config against an optimize stage given as input; returns the config with the stage's pass
    settings (what the graph was really made with, as the manifest records them) and the max sequence length."""
    opt = stage.history["optimize"]["config"]
    quant = stage.history.get("quantize", {}).get("config", {}).get("precision")
    if quant is not None and quant != config.precision:
        raise ConfigError(f"{stage.path} holds a {quant} graph; build it with --precision {quant}")
    if quant is None and config.quantization is None and opt["precision"] != config.precision:
        raise ConfigError(f"{stage.path} holds a {opt['precision']} graph; build it with --precision "
                          f"{opt['precision']}, or optimize the export again for {config.precision}")
    if config.max_seq_len is not None and config.max_seq_len > opt["max_seq_len"]:
        raise ConfigError(f"--max-seq-len {config.max_seq_len} exceeds the {opt['max_seq_len']} positions "
                          f"{stage.path} was optimized for; optimize the export again with --max-seq-len")
    # settings the stage was made with win; one asked otherwise (not left at its default) would be ignored: refused
    made: dict[str, Any] = {"keep_io_types": bool(opt["keep_io_types"]), "keep_fp32": tuple(opt["keep_fp32"]),
                            "disable_passes": tuple(opt["disable"])}
    default = BuildConfig()
    for name, value in made.items():
        asked = getattr(config, name)
        if asked != getattr(default, name) and asked != value:
            shown = list(value) if isinstance(value, tuple) else value
            raise ConfigError(f"{stage.path} was optimized with {name.replace('_', ' ')} {shown}; {asked!r} would be "
                              "ignored: drop the flag, or optimize the export again with it", field=name)
    if quant is not None and config.quantization is not None:
        from trtinfer.quantization import QuantConfig

        done, asked_q = stage.history["quantize"]["config"], config.quantization.to_dict()
        unset = QuantConfig(precision=quant).to_dict()
        diff = sorted(k for k in asked_q if asked_q[k] != unset.get(k) and asked_q[k] != done.get(k))
        if diff:  # settings given (not left at their defaults) that differ from the stage's
            was = ", ".join(f"{k}={done.get(k)!r}" for k in diff)
            given = ", ".join(f"{k}={asked_q.get(k)!r}" for k in diff)
            raise ConfigError(f"{stage.path} was quantized with {was}; the settings given ({given}) would be "
                              "ignored: drop them, or quantize the optimized graph again with them")
    config = dataclasses.replace(config, **made)
    return config, config.max_seq_len or int(opt["max_seq_len"])


def _compile(stage: StageDir, config: BuildConfig, backend: BuildBackend, max_seq: int,
             dest: Path) -> tuple[dict[str, str], EngineCheck | None, dict[str, Any] | None]:
    """Backend compilation into ``dest`` + the engine check (+ a quantized engine's held-out accuracy).

    Not cached: the engine is written once, where the user asked for it (a cached copy beside it would double the
    disk a 14B build takes); what is expensive to make again, the export and the quantized weights, is cached.
    """
    from trtinfer.passes import PassConfig
    from trtinfer.passes.embedding import TIED_EMBEDDING
    from trtinfer.passes.registry import PassContext, get_pass
    from trtinfer.runtime.memory import return_freed_memory
    from trtinfer.stage_weights import materialized

    if stage.reference_path is None:
        why = stage.history.get("export", {}).get("reference_skipped", "exported with --logits all")
        log.warning("%s has no engine-check reference (%s): the engine is not compared with the fp32 graph",
                    stage.path, why)
    return_freed_memory()  # what the stages freed (graphs are reference cycles), before the compilation's copy
    tie = get_pass(TIED_EMBEDDING)
    ctx = PassContext(PassConfig(target=backend.pass_target(config)), dict(stage.geometry))
    rewrite = None if tie.name in config.disable_passes else (lambda model: tie.fn(model, ctx) > 0)
    # an fp32 stage's weights may still be in the checkpoint: a whole copy, its tied embedding stored once
    with materialized(stage, rewrite) as whole:
        files = backend.build(whole, dest, config)
    if config.prefill is not None:
        from trtinfer.builder.prefill_graph import write_prefill_graph

        files.update(write_prefill_graph(dest, files["decoder"], config.precision, stage))
    if stage.reference_path is None:
        return files, None, _stage_accuracy(stage)
    manifest = _manifest(config, stage, files, dest, max_seq)
    return_freed_memory()  # what the export, the passes and the compilation freed, before the engine is mapped
    check = check_engine(dest, manifest, stage.reference_path, config.precision, provider=config.target,
                         graph=stage if stage.stage == "quantize" else None)
    if not check.passed:
        nan = check.max_abs_diff == float("inf")
        raise BuildError(
            f"the built engine's logits {'are not finite' if nan else f'differ from the export by {check.max_abs_diff:.4g}'}"
            f" (tolerance {check.tolerance:g} x {check.logits_scale:.3g}); "
            + ("check the model's weights, then try --keep-fp32 with more groups" if nan else
               "try --keep-fp32 with more groups, or --disable-pass to find the pass at fault"))
    from trtinfer.quantization.accuracy import HELDOUT_NAME

    accuracy = None
    if stage.stage == "quantize" and HELDOUT_NAME in stage.info["files"]:
        try:
            accuracy = {**check_accuracy(dest, manifest, stage.path / HELDOUT_NAME, provider=config.target),
                        "scored": "engine"}
        except InputError as e:  # e.g. the logits_positions pass disabled: the engine cannot score a sequence
            log.warning("the engine's accuracy is not checked: %s", e)
    return files, check, accuracy


def _check_prefill(engine: Path, manifest: Manifest, stage: StageDir) -> dict[str, Any]:
    """:func:`~trtinfer.builder.check.check_prefill` on the engine being built. A graph with its down projections in
    int8 past the bound is written again with them on the decoder's kernel and checked again; past it still, the
    build fails."""
    from trtinfer.builder.check import check_prefill
    from trtinfer.builder.prefill_graph import down_projection_alphas, write_prefill_graph

    report = check_prefill(engine, manifest, stage.path / "tokenizer.json")
    alphas = down_projection_alphas(engine)
    if not report["passed"] and alphas:
        log.warning("the int8 prefill graph with %d down projections in int8 scored x%.3f the decoder's perplexity "
                    "(bound x%s): writing it with the down projections on the decoder's kernel", len(alphas),
                    report["ratio"], report["bound"])
        write_prefill_graph(engine, manifest.files["decoder"], manifest.precision)
        report = {**check_prefill(engine, manifest, stage.path / "tokenizer.json"),
                  "ratio_with_int8_down_projections": report["ratio"]}
        alphas = []
    if not report["passed"]:
        raise BuildError(f"the int8 prefill graph's held-out perplexity is x{report['ratio']:.3f} of the decoder "
                         f"graph's alone (bound x{report['bound']}); build without --prefill")
    return {**report, "down_projection_alphas": alphas}


def _stage_accuracy(stage: StageDir) -> dict[str, Any] | None:
    """Where the engine is not checked (a model too large for the export's eager reference, whose engine would not
    load beside the build either), the held-out accuracy the quantize stage measured on its graph run piece by piece,
    for the build to judge."""
    acc = stage.history.get("quantize", {}).get("accuracy") if stage.stage == "quantize" else None
    return {**acc, "scored": "quantize-stage graph"} if acc and "ratio" in acc else None


def _check_max_seq(max_seq: int, stage: StageDir) -> None:
    """``--max-seq-len`` within the model's positions where they are a learned table (GPT-2's: a position past it
    has no row), past them with a warning for rotary models (the rotary tables are made for ``max_seq`` positions;
    the model was not trained that long, as llama.cpp warns for a context past the training one), and long enough
    for the engine check's sequences (a shorter engine cannot run them: ONNX Runtime's attention refuses them)."""
    positions = stage.geometry.get("max_position_embeddings")
    if positions and max_seq > positions:
        if stage.geometry.get("rotary") is False:
            raise ConfigError(f"--max-seq-len {max_seq} exceeds the model's {positions} learned positions "
                              f"(max_position_embeddings); use at most {positions}", field="max_seq_len")
        log.warning("--max-seq-len %d is past the %d positions the model was trained for (max_position_embeddings): "
                    "text past them may degrade", max_seq, positions)
    if max_seq < 64 and stage.reference_path is not None:
        from trtinfer.export.reference import load_reference

        prompts, tokens, _ = load_reference(stage.reference_path)
        need = max(len(p) for p in prompts) + tokens.shape[1]
        if max_seq < need:
            raise ConfigError(f"--max-seq-len {max_seq} is shorter than the engine check's sequences ({need} "
                              f"positions); use at least {need}", field="max_seq_len")


def build(model: str | Path | ResolvedModel, output_dir: str | Path, config: BuildConfig | None = None, *,
          overwrite: bool = False, progress: bool = True) -> Path:
    """Build an engine for MODEL (a model, or an export/optimize stage directory) into ``output_dir``.

    Every stage's output is cached by content hash and verified before reuse; returns the engine directory. A model
    too large for the engine check's fp32 reference is checked on a reduced-depth build of itself
    (:mod:`~trtinfer.builder.piece_check`).
    """
    config = config or BuildConfig()
    backend = get_build_backend(config.backend)
    out = Path(output_dir)
    # -o already there, a file above it, or MODEL itself (a folder: --force would replace it): now, not after the build
    check_output_dir(out, overwrite=overwrite, inputs=[model] if isinstance(model, (str, Path)) and
                     Path(model).exists() else [])
    t_start = time.perf_counter()
    if config.precision in ("fp16", "bf16") and config.target == "cpu":
        log.warning("%s on the CPU provider is for checking numerics: ONNX Runtime's CPU fp16 kernels are ~3x slower "
                    "than fp32 (SmolLM2 decode 12 vs 38 tok/s); build fp32 for CPU, fp16/bf16 for --target cuda",
                    config.precision)
    stage: StageDir | None = None
    resolved: ResolvedModel | None = model if isinstance(model, ResolvedModel) else None
    if not isinstance(model, ResolvedModel) and is_stage_dir(model):
        stage = read_stage(model)  # verified against its record: figures below describe these very files
        if stage.kind != "decoder":
            raise ConfigError(f"{model} holds an encoder export; build encoders from the model itself")
    else:
        from trtinfer.export.encoder import is_encoder
        from trtinfer.export.sources import resolve_model

        resolved = model if isinstance(model, ResolvedModel) else resolve_model(model)  # bad MODEL fails here
        if is_encoder(resolved.path):
            from trtinfer.builder.encoder_builder import build_encoder

            with atomic_dir(out, overwrite=overwrite) as tmp:
                build_encoder(resolved, tmp, config, t_start)
            log.debug("built encoder %s in %.1f s", out, time.perf_counter() - t_start)
            return out
        if config.precision == "gguf" and resolved.kind not in ("gguf", "alias"):  # an alias may be a GGUF
            raise ConfigError(f"--precision gguf keeps a GGUF file's own blocks; {model} is a "
                              f"{resolved.kind}, not a GGUF: give the .gguf file, or choose int4/int8",
                              field="precision")
    if stage is not None and stage.stage != "export":
        want = backend.pass_target(config)
        got = stage.history["optimize"]["config"]["target"]
        if got != want:
            raise ConfigError(f"{stage.path} was optimized for {got}, but --backend {config.backend} "
                              f"--target {config.target} needs {want}; optimize the export with --target {want}")
    backend.available(config)  # a missing library or device stops the build here, before any stage runs
    if config.prefill is not None:
        from trtinfer.runtime.ort_env import this_cpu_u8s8_exact

        if not this_cpu_u8s8_exact():  # the build must run the graph it checks
            raise ConfigError(f"--prefill {config.prefill} needs a CPU whose int8 GEMM is exact (x86 with VNNI, or "
                              "ARM) to check the graph it builds; this one has no VNNI: build without --prefill, or "
                              "on such a CPU")
    names = (["export"] if stage is None else []) + (["optimize"] if stage is None or stage.stage == "export" else [])
    if config.quantization is not None and (stage is None or stage.stage != "quantize"):
        names.append("quantize")
    with StageProgress([*names, "compile + check", "package"], enabled=progress) as bar:
        if stage is None:
            from trtinfer.export.onnx_export import export_cached

            with bar.stage("export") as rec:
                assert resolved is not None
                stage = export_cached(resolved, config.export, stats=rec)
        if stage.stage == "export":
            from trtinfer.passes import PassConfig
            from trtinfer.passes.optimizer import optimize_cached

            max_seq = config.max_seq_len_for(stage.geometry)
            _check_max_seq(max_seq, stage)
            pcfg = PassConfig(target=backend.pass_target(config), max_seq_len=max_seq, precision=config.pass_precision,
                              keep_io_types=config.keep_io_types, keep_fp32=config.keep_fp32,
                              disable=config.disable_passes)
            with bar.stage("optimize") as rec:
                stage = optimize_cached(stage, pcfg, stats=rec)
        else:
            config, max_seq = _from_stage(stage, config)
        if config.quantization is not None and stage.stage != "quantize":
            from trtinfer.quantization.stage import quantize_cached

            with bar.stage("quantize") as rec:
                stage = quantize_cached(stage, config.quantization, stats=rec, progress=progress)
        with atomic_dir(out, overwrite=overwrite) as tmp:  # nothing is left at -o if a check fails
            piece = None
            with bar.stage("compile + check"):
                files, check, accuracy = _compile(stage, config, backend, max_seq, tmp)
                if (check is None and resolved is not None and config.export.layers is None and config.reduced_depth_check
                        and stage.history.get("export", {}).get("reference_skipped")):
                    from trtinfer.builder.piece_check import reduced_depth_check

                    piece = reduced_depth_check(resolved, config, stage.geometry, out)
                prefill = (None if config.prefill is None else
                           _check_prefill(tmp, _manifest(config, stage, files, tmp, max_seq), stage))
            if accuracy is not None:
                from trtinfer.quantization.accuracy import accuracy_verdict, verdict_error

                accuracy = accuracy_verdict(accuracy, config.precision, config.max_perplexity_ratio)
                if not accuracy["passed"]:
                    raise BuildError(verdict_error(accuracy, config.precision))
            with bar.stage("package"):
                stage.copy_files(TOKENIZER_FILES, tmp)
                manifest = _manifest(config, stage, files, tmp, max_seq).updated(
                    **({} if check is None else {"engine_check": check.to_dict()}), accuracy_check=accuracy,
                    **({} if piece is None else {"reduced_depth_check": piece}),
                    **({} if prefill is None else {"prefill_check": prefill}), stages=bar.records,
                    build_seconds=round(time.perf_counter() - t_start, 2))
                write_manifest(tmp, manifest)
    log.debug("built %s in %.1f s", out, time.perf_counter() - t_start)
    return out

