"""The quantize stage: an optimized fp32 stage directory -> a quantized stage directory ``trtinfer build`` takes.

    trtinfer optimize X -o Y                  (fp32 graph for a target)
    trtinfer quantize Y -o Z --precision P    (this stage: graph rewritten, calibration files, accuracy report)
    trtinfer build Z -o ENGINE

The stage record keeps everything earlier stages wrote and adds ``history.quantize``: the config, what the
precision rewrote (its report), the calibration (computed or reused) and the accuracy report (perplexity on a
held-out text and top-1 next-token agreement against the fp32 graph it came from).
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from trtinfer._cache import key_of
from trtinfer.artifact import ONNX_NAME, StageDir, read_stage, write_stage
from trtinfer.errors import ConfigError
from trtinfer.quantization.config import QuantConfig
from trtinfer.quantization.registry import SCRATCH_NAME, QuantContext, get_precision
from trtinfer.stages import cached_stage, carry_forward, graph_io, make_stage, package_versions

log = logging.getLogger(__name__)

QUANTIZE_FORMAT = 10  # bump when what the quantize stage writes changes (invalidates cached quantized graphs)
CALIBRATION_FILES = ("calibration.json", "calibration.cache")


def quant_versions() -> dict[str, str]:
    """Versions the quantized graph depends on (package metadata only)."""
    return package_versions("onnx", "onnx-ir", "onnxruntime", "numpy")


def check_input(src: StageDir) -> str:
    """The pass target of an optimize stage that can be quantized, or a one-line error saying what to give."""
    if src.stage == "quantize":
        done = src.history["quantize"]["config"]["precision"]
        raise ConfigError(f"{src.path} is already quantized ({done}); give the `trtinfer optimize` directory it "
                          "came from")
    if src.stage != "optimize":
        raise ConfigError(f"{src.path} is an export; quantize runs on an optimized fp32 graph: run `trtinfer optimize "
                          f"{src.path} -o DIR` first (or `trtinfer build MODEL --precision ...` for everything)")
    opt = src.history["optimize"]["config"]
    if opt["precision"] != "fp32":
        raise ConfigError(f"{src.path} holds a {opt['precision']} graph; quantize an fp32 optimize stage")
    return str(opt["target"])


def _rewrite(src: StageDir, folder: Path, config: QuantConfig, target: str, progress: bool) -> dict[str, Any]:
    """Quantize ``src``'s graph with ``config`` into ``folder``; returns the precision's report.

    The graph's checkpoint weights are read as the precision reaches them (calibration runs the graph piece by piece,
    or materializes it where it runs whole). Every weight of the result is written: a quantize stage refers to no
    checkpoint.
    """
    from trtinfer.stage_weights import load_graph, save_graph

    model = load_graph(src.onnx_path)
    report = get_precision(config.precision, target).fn(model, QuantContext(src, config, target, folder, progress))
    save_graph(model, folder / ONNX_NAME, keep_references=False)
    shutil.rmtree(folder / SCRATCH_NAME, ignore_errors=True)
    return report


def _accuracy(src: StageDir, folder: Path, progress: bool) -> dict[str, Any]:
    """The accuracy report of the quantized graph in ``folder`` against ``src``'s fp32 graph, both run piece by piece
    (:func:`~trtinfer.quantization.accuracy.accuracy_report`), so it fits whatever the model's size."""
    from trtinfer.quantization.accuracy import accuracy_report

    return accuracy_report(src, folder, progress=progress)


def _check_fits(config: QuantConfig, fits: bool, figures: str) -> None:
    """Refuse a calibration on the whole fp32 graph where that graph does not fit (GPTQ's statistics run it piece by
    piece: :mod:`trtinfer.calibration.pieces`)."""
    if fits or not config.needs_calibration or config.precision == "int4":
        return
    raise ConfigError(f"{config.precision} calibrates on the fp32 graph, which does not fit ({figures}); "
                      "use --precision int4 or int8 (weight-only)")


def _quantize_into(src: StageDir, folder: Path, config: QuantConfig, progress: bool) -> StageDir:
    from trtinfer.quantization.accuracy import FALLBACK_FP32, PERPLEXITY_BOUNDS
    from trtinfer.runtime.memory import whole_copy_fits
    from trtinfer.stage_weights import graph_weight_bytes

    target = check_input(src)
    get_precision(config.precision, target)  # an unknown precision/target pair fails before any work
    t0 = time.perf_counter()
    fits, figures = whole_copy_fits(graph_weight_bytes(src.onnx_path), folder)
    _check_fits(config, fits, figures)
    report = _rewrite(src, folder, config, target, progress)
    accuracy = _accuracy(src, folder, progress)
    fallback = tuple(p for p in FALLBACK_FP32.get(config.precision, ()) if p not in config.skip_patterns)
    bound = PERPLEXITY_BOUNDS[config.precision]
    if fallback and "ratio" in accuracy and not accuracy["ratio"] <= bound:
        why = (f"perplexity x{accuracy['ratio']:.3f} with every GEMM quantized, over the x{bound:g} bound")
        log.info("%s; quantizing again with %s in fp32", why, ", ".join(fallback))
        config = dataclasses.replace(config, keep_fp32=config.keep_fp32 + fallback)
        report = _rewrite(src, folder, config, target, progress)
        report["fallback"] = {"kept_fp32": list(fallback), "because": why, "accuracy_before": accuracy}
        accuracy = _accuracy(src, folder, progress)
    seconds = round(time.perf_counter() - t0, 2)
    info = {**carry_forward(src, folder), "stage": "quantize", "io": graph_io(folder / ONNX_NAME),
            "kv_layout": src.kv_layout}
    info["history"]["quantize"] = {"config": config.to_dict(), "target": target, "seconds": seconds,
                                   "report": report, "accuracy": accuracy, "format": QUANTIZE_FORMAT,
                                   "versions": quant_versions()}
    return write_stage(folder, info)


def quantize_stage(src: str | Path | StageDir, output_dir: str | Path, config: QuantConfig | None = None, *,
                   overwrite: bool = False, progress: bool = True) -> StageDir:
    """Quantize the optimize stage ``src`` into the stage directory ``output_dir`` (see the module docstring)."""
    config = config or QuantConfig()
    stage = src if isinstance(src, StageDir) else read_stage(src)
    check_input(stage)
    return make_stage(output_dir, lambda tmp: _quantize_into(stage, tmp, config, progress), overwrite=overwrite,
                      source=stage.path)


def _calibration_key(config: QuantConfig) -> Any:
    """What of the calibration data enters the cache key: a given file's content, not its path."""
    cal = config.calibration
    if not config.needs_calibration:
        return None
    from trtinfer._cache import sha256_file

    files = {}
    for name in ("source", "cache_file"):
        path = getattr(cal, name, None)
        if path is not None and Path(path).is_file():
            files[name] = sha256_file(Path(path))
    return files


def quantize_cached(src: StageDir, config: QuantConfig, *, stats: dict[str, Any] | None = None,
                    progress: bool = True) -> StageDir:
    """:func:`quantize_stage` into ``~/.cache/trtinfer/quantized/<hash of input, config, data, versions>``, reused."""
    check_input(src)
    key = key_of([QUANTIZE_FORMAT, src.content_key(), config.to_dict(), _calibration_key(config), quant_versions()])
    return cached_stage("quantized", key, lambda tmp: _quantize_into(src, tmp, config, progress), stats)
