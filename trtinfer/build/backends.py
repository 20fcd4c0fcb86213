"""Build backends, registered by name. A backend turns a validated export into engine files."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from trtinfer.build.config import BuildConfig
from trtinfer.errors import BuildError, ConfigError
from trtinfer.export.onnx_export import DATA_NAME, ExportResult

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


def write_kv_select(path: Path, n_tensors: int) -> None:
    """Write the tiny graph that keeps chosen batch rows of every KV tensor: ``out.i = Gather(kv.i, rows, axis=0)``."""
    import onnx
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info("rows", TensorProto.INT64, ["rows"])]
    outputs, nodes = [], []
    for i in range(n_tensors):
        inputs.append(helper.make_tensor_value_info(f"kv.{i}", TensorProto.FLOAT, ["batch", "heads", "len", "dim"]))
        outputs.append(helper.make_tensor_value_info(f"out.{i}", TensorProto.FLOAT, ["rows", "heads", "len", "dim"]))
        nodes.append(helper.make_node("Gather", [f"kv.{i}", "rows"], [f"out.{i}"], axis=0, name=f"select_{i}"))
    graph = helper.make_graph(nodes, "kv_select", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="trtinfer", ir_version=9)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


@register_build_backend("onnxruntime")
def build_onnxruntime(exported: ExportResult, out: Path, config: BuildConfig) -> dict[str, str]:
    """Optimize the graph offline with ONNX Runtime for ``config.target`` and save it; the runtime loads it as is."""
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
    try:
        ort.InferenceSession(str(exported.onnx_path), so, providers=providers)
    except Exception as e:
        raise BuildError(f"ONNX Runtime could not optimize {exported.onnx_path}: {e}") from e
    n_kv = 2 * exported.info["geometry"]["num_layers"]
    write_kv_select(out / "kv_select.onnx", n_kv)
    return {"decoder": "model.onnx", "decoder_data": DATA_NAME, "kv_select": "kv_select.onnx"}


def op_histogram(path: Path) -> dict[str, int]:
    """Count of each op type in an ONNX file (weights not loaded)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    hist: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))

