"""Build backends, registered by name. A backend compiles an optimize stage's graph into engine files."""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtinfer.artifact import DATA_NAME, ONNX_NAME, StageDir
from trtinfer.builder.config import BuildConfig
from trtinfer.errors import BackendUnavailableError, BuildError, ConfigError
from trtinfer.runtime.memory import PREPACK_OFF

log = logging.getLogger(__name__)

BackendFn = Callable[[StageDir, Path, BuildConfig], dict[str, str]]
TargetFn = Callable[[BuildConfig], str]
CheckFn = Callable[[BuildConfig], None]


def _always(config: BuildConfig) -> None:
    """Backends whose libraries are trtinfer's own dependencies are always available."""


@dataclass(frozen=True)
class BuildBackend:
    """A registered backend: ``build(stage, out_dir, config) -> {role: file}`` on the optimize stage made for
    ``pass_target(config)`` (the pass pipeline whose output it compiles). ``available(config)`` raises
    BackendUnavailableError when the backend's libraries or device are missing: a build calls it before any work, so
    it stops at once and leaves nothing behind."""

    name: str
    build: BackendFn
    pass_target: TargetFn
    available: CheckFn = _always
    versions: Callable[[], dict[str, str]] = dict  # what else ties its output to this machine (cache key, manifest)


_BACKENDS: dict[str, BuildBackend] = {}
_LAZY = {"tensorrt": "trtinfer.builder.trt_backend"}  # registered on first use: their modules import more


def register_build_backend(name: str, pass_target: TargetFn, available: CheckFn = _always,
                           versions: Callable[[], dict[str, str]] = dict) -> Callable[[BackendFn], BackendFn]:
    """Decorator: register ``fn(stage, out_dir, config) -> {role: file}`` as build backend ``name``."""

    def deco(fn: BackendFn) -> BackendFn:
        _BACKENDS[name] = BuildBackend(name, fn, pass_target, available, versions)
        return fn

    return deco


def get_build_backend(name: str) -> BuildBackend:
    """The backend called ``name``, or an error listing the known ones."""
    if name not in _BACKENDS and name in _LAZY:
        importlib.import_module(_LAZY[name])  # registers it
    if name not in _BACKENDS:
        raise ConfigError(f"unknown backend '{name}'; known: {', '.join(sorted({*_BACKENDS, *_LAZY}))}")
    return _BACKENDS[name]


def _check_onnxruntime(config: BuildConfig) -> None:
    """``--target cuda`` needs onnxruntime-gpu's CUDA provider on the build machine (its libraries preloaded first)."""
    if config.target != "cuda":
        return
    import onnxruntime as ort

    from trtinfer.runtime.ort_env import preload_cuda_libraries

    preload_cuda_libraries(ort)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise BackendUnavailableError("target 'cuda' needs onnxruntime-gpu (CUDAExecutionProvider) on the build "
                                      "machine; build with --target cpu or install 'trtinfer[gpu]'")


@register_build_backend("onnxruntime", pass_target=lambda config: f"onnxruntime-{config.target}",
                        available=_check_onnxruntime)
def build_onnxruntime(stage: StageDir, out: Path, config: BuildConfig) -> dict[str, str]:
    """ONNX Runtime's offline optimization of the optimize stage's graph, saved as the engine graph."""
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if config.target == "cuda":
        _check_onnxruntime(config)
        providers.insert(0, "CUDAExecutionProvider")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # EXTENDED: all transformer fusions; ALL would add CPU-layout rewrites not meant to be saved
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out / ONNX_NAME)
    # this session only writes the optimized graph: MLAS's packed copy of every weight would double the build's peak
    so.add_session_config_entry(PREPACK_OFF, "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA_NAME)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    try:
        ort.InferenceSession(str(stage.onnx_path), so, providers=providers)
    except Exception as e:
        raise BuildError(f"ONNX Runtime could not optimize {stage.onnx_path}: {e}") from e
    if config.target == "cpu":  # a tied table read by a gather and a prepacked head: one mapping each
        from trtinfer.builder.weight_views import one_name_per_reader

        one_name_per_reader(out / ONNX_NAME)
    return {"decoder": ONNX_NAME, "decoder_data": DATA_NAME}


def op_histogram(path: Path) -> dict[str, int]:
    """Count of each op type in an ONNX file (weights not loaded)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    hist: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))



FUSED_OPS = {
    "attention": ("GroupQueryAttention", "MultiHeadAttention", "Attention"),
    "norm": ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
             "SkipLayerNormalization", "RMSNormalization", "EmbedLayerNormalization"),
    "gelu": ("Gelu", "FastGelu", "BiasGelu"),
}


#: families whose fused op one pass emits: its report's ``fired`` is kept next to the engine graph's count
FUSING_PASS = {"attention": "attention", "gelu": "gelu"}


def fused_op_counts(hist: dict[str, int], geometry: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Fused ops in the final graph by family, next to how many the model should have.

    ``count`` is read from the engine graph's op histogram, the one source of truth: the backend may expand a fused
    op again (ONNX Runtime's CPU provider inlines an fp16 ``FastGelu``, having no kernel for it). Where that count
    differs from what the fusing pass reported, ``by_passes`` keeps the pass's figure.
    """
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
    for family, name in FUSING_PASS.items():
        fired = (report.get("fusions", {}).get(name) or {}).get("fired")
        if fired is not None and fired != out[family]["count"]:
            out[family]["by_passes"] = fired
    return out
