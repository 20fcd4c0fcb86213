"""Run a target's pipeline over a model: ``optimize(IN.onnx, OUT.onnx, config) -> FusionReport``."""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx_ir as ir

from trtinfer.errors import ConfigError, InputError
from trtinfer.passes.config import PassConfig
from trtinfer.passes.registry import GEOMETRY_KEY, PassContext, get_pass, get_pipeline
from trtinfer.passes.report import FusionReport, PassRecord

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
    model.metadata_props[REPORT_KEY] = json.dumps(report.to_dict())
    if ctx.geometry:
        model.metadata_props[GEOMETRY_KEY] = json.dumps(ctx.geometry)
    return report


def load_model(path: Path) -> ir.Model:
    """Load an ONNX file (external data resolved next to it) into onnx-ir, with a clear error if it is not one."""
    if not path.is_file():
        raise InputError(f"{path} does not exist; give an .onnx file")
    try:
        return ir.load(str(path))
    except Exception as e:
        raise InputError(f"{path} is not a readable ONNX model: {e}") from e


def save_model(model: ir.Model, path: Path) -> None:
    """Save with weights in ``<name>.data`` beside the graph (graphs over 2 GB need it; small ones stay inline)."""
    ir.save(model, str(path), external_data=path.name + ".data", size_threshold_bytes=1024)


def optimize(in_path: str | Path, out_path: str | Path, config: PassConfig | None = None,
             geometry: dict[str, Any] | None = None) -> FusionReport:
    """Optimize the ONNX file ``in_path`` for ``config.target`` into ``out_path`` (+ ``.data``)."""
    src, dst = Path(in_path), Path(out_path)
    if dst.suffix != ".onnx":
        raise ConfigError(f"output must be an .onnx file path, got {dst}")
    if geometry is None and (src.parent / "export.json").is_file():
        geometry = json.loads((src.parent / "export.json").read_text()).get("geometry")
    model = load_model(src)
    report = optimize_model(model, config, geometry)
    # write into a temp folder beside the destination, then move the files in: no half-written model on failure
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        save_model(model, tmp / dst.name)
        for f in tmp.iterdir():
            f.replace(dst.parent / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report
