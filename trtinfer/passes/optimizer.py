"""Run a target's pipeline over a model: ``optimize(IN.onnx, OUT.onnx, config) -> FusionReport`` on files, and
``optimize_stage(EXPORT_DIR, OUT_DIR, config) -> StageDir`` on stage directories (what ``trtinfer build`` chains)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import onnx_ir as ir

from trtinfer._cache import key_of
from trtinfer._outputs import scratch_dir
from trtinfer.artifact import ONNX_NAME, StageDir, is_stage_dir, read_stage, write_stage
from trtinfer.errors import ConfigError, InputError
from trtinfer.passes.config import PassConfig
from trtinfer.passes.layout import CONCAT, LAYOUT_KEY
from trtinfer.passes.registry import GEOMETRY_KEY, PassContext, get_pass, get_pipeline
from trtinfer.passes.report import FusionReport, PassRecord
from trtinfer.stage_weights import CHECKPOINT_COUNT, CHECKPOINT_KEY, load_graph, release_weights, save_graph
from trtinfer.stages import cached_stage, carry_forward, graph_io, make_stage, package_versions

log = logging.getLogger(__name__)

REPORT_KEY = "trtinfer.fusion_report"


def count_nodes(model: ir.Model) -> int:
    """Nodes of the main graph."""
    return sum(1 for _ in model.graph)


def optimize_model(model: ir.Model, config: PassConfig | None = None,
                   geometry: dict[str, Any] | None = None) -> FusionReport:
    """Run ``config.target``'s pipeline on ``model`` in place; returns what each pass did."""
    config = config or PassConfig()
    for name in config.disable:
        get_pass(name)  # unknown names fail loudly, listing the known ones
    ctx = PassContext.for_model(model, config, geometry)
    report = FusionReport(config.target, nodes_before=count_nodes(model))
    for spec in get_pipeline(config.target):
        if spec.name in config.disable:
            continue
        t0 = time.perf_counter()
        fired = spec.fn(model, ctx)
        expected = spec.expected(ctx) if spec.expected else None
        report.add(PassRecord(spec.name, spec.kind, fired, expected, time.perf_counter() - t0))
        log.debug("pass %s fired %d (expected %s)", spec.name, fired, expected)
    report.nodes_after = count_nodes(model)
    for w in report.warnings:
        log.warning("%s", w)
    # no timings in the graph: its bytes key the next stage's cache entry, which a pass taking 0.46 s instead of
    # 0.42 must not change (the stage record keeps them)
    model.metadata_props[REPORT_KEY] = json.dumps(report.to_dict(timings=False))
    if ctx.geometry:
        model.metadata_props[GEOMETRY_KEY] = json.dumps(ctx.geometry)
    return report


def load_model(path: Path) -> ir.Model:
    """Load an ONNX file (external data resolved next to it, checkpoint weights bound) into onnx-ir, with a clear
    error if it is not one."""
    if not path.is_file():
        raise InputError(f"{path} does not exist; give an .onnx file")
    return load_graph(path, InputError)


def optimize(in_path: str | Path, out_path: str | Path, config: PassConfig | None = None,
             geometry: dict[str, Any] | None = None) -> FusionReport:
    """Optimize the ONNX file ``in_path`` for ``config.target`` into ``out_path`` (+ ``.data``)."""
    src, dst = Path(in_path), Path(out_path)
    if dst.suffix != ".onnx":
        raise ConfigError(f"output must be an .onnx file path, got {dst}")
    if geometry is None and is_stage_dir(src.parent):
        geometry = read_stage(src.parent, verify=False).geometry
    model = load_model(src)
    report = optimize_model(model, config, geometry)
    # write into a temp folder beside the destination, then move the files in: no half-written model on failure
    dst.parent.mkdir(parents=True, exist_ok=True)
    with scratch_dir(dst.parent, dst.name) as tmp:
        save_graph(model, tmp / dst.name)  # the weights the passes left as they were stay in the checkpoint
        release_weights(model)
        for f in tmp.iterdir():
            f.replace(dst.parent / f.name)
    return report


OPTIMIZE_FORMAT = 5  # bump when what the optimize stage writes changes (invalidates cached optimized graphs)


def _optimize_into(src: StageDir, folder: Path, config: PassConfig) -> StageDir:
    """Run ``config``'s pipeline on the export stage ``src`` and write the optimize stage into ``folder``."""
    if src.stage != "export":
        opt = src.history.get("optimize", {}).get("config", {})
        raise ConfigError(f"{src.path} is already optimized (for {opt.get('target')}, {opt.get('precision')}); "
                          "give the export directory it came from")
    if src.kind != "decoder":
        raise ConfigError(f"{src.path} holds an encoder export; encoders are fused at build time: "
                          "run `trtinfer build MODEL` on the model itself")
    t0 = time.perf_counter()
    report = optimize(src.onnx_path, folder / ONNX_NAME, config, geometry=src.geometry)
    import onnx

    props = {p.key: p.value for p in onnx.load(str(folder / ONNX_NAME), load_external_data=False).metadata_props}
    info = {**carry_forward(src, folder), "stage": "optimize", "io": graph_io(folder / ONNX_NAME),
            "kv_layout": props.get(LAYOUT_KEY, CONCAT),
            CHECKPOINT_COUNT: len(json.loads(props[CHECKPOINT_KEY])["weights"]) if CHECKPOINT_KEY in props else 0}
    info["history"]["optimize"] = {"config": config.to_dict(), "seconds": round(time.perf_counter() - t0, 2),
                                   "fusion_report": report.to_dict(), "format": OPTIMIZE_FORMAT,
                                   "versions": pass_versions()}
    return write_stage(folder, info)


def pass_versions() -> dict[str, str]:
    """Versions of what the passes depend on (from package metadata; nothing is imported)."""
    return package_versions("onnx", "onnx-ir", "onnxscript", "onnxruntime")


def optimize_stage(src: str | Path | StageDir, output_dir: str | Path, config: PassConfig | None = None, *,
                   overwrite: bool = False) -> StageDir:
    """Optimize the export stage directory ``src`` for ``config.target`` into the stage directory ``output_dir``.

    ``output_dir`` gets the optimized graph, the export's tokenizer files and engine-check reference, and a
    ``stage.json`` that keeps the export's facts and validation and adds this pass config and fusion report;
    ``trtinfer build`` takes it as input.
    """
    config = config or PassConfig()
    stage = src if isinstance(src, StageDir) else read_stage(src)
    return make_stage(output_dir, lambda tmp: _optimize_into(stage, tmp, config), overwrite=overwrite,
                      source=stage.path)


def optimize_cached(src: StageDir, config: PassConfig, *, stats: dict[str, Any] | None = None) -> StageDir:
    """:func:`optimize_stage` into ``~/.cache/trtinfer/optimized/<hash of the export, config, versions>``, reused.

    ``stats["cached"]`` tells whether the entry was reused.
    """
    key = key_of([OPTIMIZE_FORMAT, src.content_key(), config.to_dict(), pass_versions()])
    return cached_stage("optimized", key, lambda tmp: _optimize_into(src, tmp, config), stats)
