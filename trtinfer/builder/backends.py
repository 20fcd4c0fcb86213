"""Build backends, registered by name. A backend turns a validated export into engine files."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trtinfer.builder.config import BuildConfig
from trtinfer.errors import BuildError, ConfigError
from trtinfer.export.onnx_export import DATA_NAME, ExportResult
from trtinfer.runtime.manifest import kv_dtype

log = logging.getLogger(__name__)

BackendFn = Callable[[ExportResult, Path, BuildConfig], dict[str, str]]
_BACKENDS: dict[str, BackendFn] = {}


def register_build_backend(name: str) -> Callable[[BackendFn], BackendFn]:
    """Decorator: register ``fn(export, out_dir, config) -> {role: file}`` as build backend ``name``."""

    def deco(fn: BackendFn) -> BackendFn:
        _BACKENDS[name] = fn
        return fn

    return deco


def get_build_backend(name: str) -> BackendFn:
    """The backend called ``name``, or an error listing the known ones."""
    if name not in _BACKENDS:
        raise ConfigError(f"unknown backend '{name}'; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]


def write_kv_select(path: Path, n_tensors: int, dtype: str = "float32") -> None:
    """Write the tiny graph that keeps chosen batch rows of every KV tensor: ``out.i = Gather(kv.i, rows, axis=0)``."""
    import onnx
    from onnx import TensorProto, helper

    elem = {name: code for code, name in _DTYPES.items()}[dtype]
    inputs = [helper.make_tensor_value_info("rows", TensorProto.INT64, ["rows"])]
    outputs, nodes = [], []
    for i in range(n_tensors):
        inputs.append(helper.make_tensor_value_info(f"kv.{i}", elem, ["batch", "heads", "len", "dim"]))
        outputs.append(helper.make_tensor_value_info(f"out.{i}", elem, ["rows", "heads", "len", "dim"]))
        nodes.append(helper.make_node("Gather", [f"kv.{i}", "rows"], [f"out.{i}"], axis=0, name=f"select_{i}"))
    graph = helper.make_graph(nodes, "kv_select", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="trtinfer", ir_version=9)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def run_pipeline(exported: ExportResult, out: Path, config: BuildConfig, target: str) -> tuple[Path, dict[str, Any]]:
    """Run our pass pipeline for ``target`` on the export into ``out/passes/``; returns the graph and its report."""
    from trtinfer.passes import PassConfig, optimize

    pcfg = PassConfig(target=target, max_seq_len=config.max_seq_len_for(exported.info["geometry"]), precision=config.precision,
                      keep_io_types=config.keep_io_types, keep_fp32=config.keep_fp32, disable=config.disable_passes)
    dst = out / "passes" / "model.onnx"
    report = optimize(exported.onnx_path, dst, pcfg, geometry=exported.info["geometry"])
    return dst, report.to_dict()


@register_build_backend("onnxruntime")
def build_onnxruntime(exported: ExportResult, out: Path, config: BuildConfig) -> dict[str, str]:
    """Run the ``onnxruntime-<target>`` pass pipeline, then ONNX Runtime's offline optimization; save the result."""
    import shutil

    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if config.target == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BuildError("target 'cuda' needs onnxruntime-gpu (CUDAExecutionProvider) on the build machine; "
                             "build with --target cpu or install 'trtinfer[gpu]'")
        providers.insert(0, "CUDAExecutionProvider")
    so = ort.SessionOptions()
    # EXTENDED: all transformer fusions; ALL would add CPU-layout rewrites not meant to be saved
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out / "model.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA_NAME)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    graph, report = run_pipeline(exported, out, config, f"onnxruntime-{config.target}")
    (out / "fusion_report.json").write_text(json.dumps(report, indent=2))
    try:
        ort.InferenceSession(str(graph), so, providers=providers)
    except Exception as e:
        raise BuildError(f"ONNX Runtime could not optimize {graph}: {e}") from e
    shutil.rmtree(out / "passes")
    n_kv = 2 * exported.info["geometry"]["num_layers"]
    write_kv_select(out / "kv_select.onnx", n_kv, kv_dtype(graph_io(out / "model.onnx")))
    return {"decoder": "model.onnx", "decoder_data": DATA_NAME, "kv_select": "kv_select.onnx",
            "fusion_report": "fusion_report.json"}


def op_histogram(path: Path) -> dict[str, int]:
    """Count of each op type in an ONNX file (weights not loaded)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    hist: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))



_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64"}


def graph_io(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Names, dtypes and shapes (symbolic names or ints) of an ONNX file's inputs and outputs."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def spec(vi: Any) -> dict[str, Any]:
        t = vi.type.tensor_type
        dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]
        return {"name": vi.name, "dtype": _DTYPES.get(t.elem_type, str(t.elem_type)), "shape": dims}

    inits = {i.name for i in model.graph.initializer}
    return {"inputs": [spec(v) for v in model.graph.input if v.name not in inits],
            "outputs": [spec(v) for v in model.graph.output]}


FUSED_OPS = {
    "attention": ("GroupQueryAttention", "MultiHeadAttention", "Attention"),
    "norm": ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
             "SkipLayerNormalization", "RMSNormalization", "EmbedLayerNormalization"),
    "gelu": ("Gelu", "FastGelu", "BiasGelu"),
}


def fused_op_counts(hist: dict[str, int], geometry: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Fused ops in the final graph by family, next to how many the model should have."""
    def count(names: tuple[str, ...]) -> int:
        return sum(n for k, n in hist.items() if k.split(".")[-1] in names)

    layers = geometry.get("num_layers")
    attn_expected = (report.get("fusions", {}).get("attention", {}) or {}).get("expected", layers)
    out: dict[str, Any] = {
        "attention": {"count": count(FUSED_OPS["attention"]), "expected": attn_expected},
        "norm": {"count": count(FUSED_OPS["norm"]), "expected": geometry.get("num_norms")},
        "gelu": {"count": count(FUSED_OPS["gelu"]),
                 "expected": (report.get("fusions", {}).get("gelu") or {}).get("expected")},
    }
    # rotary lives inside GroupQueryAttention (do_rotary=1): the pass report counts it
    rotary = report.get("fusions", {}).get("rotary") or {}
    out["rotary"] = {"count": rotary.get("fired", 0), "expected": rotary.get("expected")}
    return out
