"""``--backend tensorrt``: the ``tensorrt`` pass target's graph -> a serialized TensorRT engine with two profiles.

The build is a handful of small functions, each naming the documented TensorRT Python API it relies on (TensorRT 10
Python API reference, docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/)::

    require_tensorrt()        import tensorrt; a GPU through cuda-python            -> one line when either is missing
    parse_network()           Builder(logger).create_network(1 << STRONGLY_TYPED); OnnxParser(network, logger)
                              .parse_from_file(path); parser.num_errors / get_error(i): code(), desc(), node(),
                              node_name(), node_operator()                          -> every rejected node named
    add_greedy_output()       INetworkDefinition.add_topk(logits, TopKOperation.MAX, 1, axes) + mark_output
    builder_config()          create_builder_config(); set_memory_pool_limit(MemoryPoolType.WORKSPACE, n);
                              create_timing_cache(bytes) / set_timing_cache(cache, ignore_mismatch=False);
                              progress_monitor = IProgressMonitor subclass; create_optimization_profile() /
                              set_shape(name, min, opt, max) / add_optimization_profile(profile)
    build_tensorrt()          build_serialized_network(network, config) -> plan bytes; timing cache serialize()

The network is **strongly typed**: every tensor's type comes from the graph (fp16/bf16 from the precision pass, INT8
and INT4 from the quantize stage's Q/DQ nodes), so no builder precision flag (FP16, INT8, ...) is set and no
calibrator exists (TensorRT 10.1 deprecated implicit INT8 calibration; strongly typed networks refuse those flags).
Profile shapes are planned in plain Python (:mod:`trtinfer.runtime.trt_plan`).

Not executed in this repository: TensorRT cannot be installed on any machine we have (README "what is verified
where"). The code type-checks against ``tensorrt-stubs`` (tests/builder/test_tensorrt_types.py) and the planning is
unit-tested.
"""
from __future__ import annotations

# tensorrt is imported inside each function, after require_tensorrt(): the module loads without it, and mypy checks
# every call against tensorrt-stubs (annotations name its types; postponed, so never evaluated at run time)
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trtinfer._cache import cache_root
from trtinfer.artifact import ONNX_NAME, StageDir
from trtinfer.builder.backends import register_build_backend
from trtinfer.builder.config import BuildConfig
from trtinfer.errors import BackendUnavailableError, BuildError
from trtinfer.runtime.trt_plan import ProfilePlan, plan_profiles
from trtinfer.stages import graph_io

if TYPE_CHECKING:
    import tensorrt as trt

log = logging.getLogger(__name__)

ENGINE_NAME = "decoder.engine"
NETWORK_NAME = "network.onnx"  # the graph the engine was built from, weights left out (I/O, op histogram, inspect)
INFO_NAME = "tensorrt.json"
GREEDY_OUTPUT = "greedy_ids"  # [B,K,1] int32: argmax of the logits, computed on the device
DEFAULT_WORKSPACE_MIB = 4096
MAX_REPORTED_ERRORS = 10


def require_tensorrt() -> None:
    """The ``tensorrt`` module and a visible GPU, or BackendUnavailableError saying which is missing and what to do."""
    from trtinfer.runtime.cuda import CudaError, device_info
    from trtinfer.runtime.trt_session import import_tensorrt

    import_tensorrt("--backend tensorrt")

    try:
        device_info(0)
    except CudaError as e:
        raise BackendUnavailableError(f"--backend tensorrt needs an NVIDIA GPU: {e}; build on a GPU machine, or with "
                                      "--backend onnxruntime") from e


def engine_fingerprint(device_id: int = 0) -> dict[str, str]:
    """What ties a plan to this machine: TensorRT version (``trt.__version__``), GPU name and compute capability."""
    import tensorrt as trt

    from trtinfer.runtime.cuda import device_info

    return {"tensorrt_version": str(trt.__version__), **device_info(device_id)}


def parse_network(onnx_path: Path,
                  logger: trt.ILogger) -> tuple[trt.Builder, trt.INetworkDefinition, trt.OnnxParser]:
    """Parse ``onnx_path`` into a strongly typed network; BuildError listing each node the parser rejected.

    Returns ``(builder, network, parser)`` (the parser owns weights the network points at: keep it alive).
    """
    import tensorrt as trt

    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # external weights are read from beside the file
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        lines = [f"node {e.node()} '{e.node_name()}' ({e.node_operator()}): {e.desc()}" for e in errors]
        more = f"; and {len(lines) - MAX_REPORTED_ERRORS} more" if len(lines) > MAX_REPORTED_ERRORS else ""
        raise BuildError(f"TensorRT's ONNX parser rejected {onnx_path}: " + "; ".join(lines[:MAX_REPORTED_ERRORS])
                         + more + ". `trtinfer inspect DIR --target tensorrt` lists what it cannot import")
    return builder, network, parser


def add_greedy_output(network: trt.INetworkDefinition) -> None:
    """Mark ``greedy_ids = argmax(logits, -1)`` as an extra output (top-1 of a TopK layer over the vocab axis), so a
    greedy step moves token ids, not logits, from the device."""
    import tensorrt as trt

    logits = next((network.get_output(i) for i in range(network.num_outputs)
                   if network.get_output(i).name == "logits"), None)
    if logits is None:
        raise BuildError("the graph has no 'logits' output; build from a trtinfer optimize stage")
    axes = 1 << (len(logits.shape) - 1)  # reduceAxes is a bit mask
    topk = network.add_topk(logits, trt.TopKOperation.MAX, 1, axes)
    ids = topk.get_output(1)
    ids.name = GREEDY_OUTPUT
    network.mark_output(ids)


def default_timing_cache(fingerprint: dict[str, str]) -> Path:
    """The shared timing cache of this TensorRT version and GPU under the trtinfer cache."""
    tag = f"{fingerprint['tensorrt_version']}-sm{fingerprint['compute_capability'].replace('.', '')}"
    return cache_root() / "tensorrt" / f"timing-{tag}.cache"


def _progress_monitor() -> trt.IProgressMonitor:
    """An ``IProgressMonitor`` drawing one tqdm bar per build phase (TensorRT calls it from the build thread)."""
    import tensorrt as trt
    from tqdm import tqdm

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.bars: dict[str, Any] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            depth = 0 if parent_phase is None else 1 + int(parent_phase in self.bars)
            self.bars[phase_name] = tqdm(total=num_steps, desc=phase_name, position=depth, leave=depth == 0)

        def step_complete(self, phase_name: str, step: int) -> bool:
            bar = self.bars.get(phase_name)
            if bar is not None:
                bar.update(step + 1 - bar.n)
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            bar = self.bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return Monitor()


def builder_config(builder: trt.Builder, plan: ProfilePlan, workspace_mib: int, timing_cache: bytes,
                   progress: bool) -> trt.IBuilderConfig:
    """The IBuilderConfig: workspace limit, timing cache, progress monitor and one optimization profile per plan entry."""
    import tensorrt as trt

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    cache = config.create_timing_cache(timing_cache)  # empty bytes: a new cache
    config.set_timing_cache(cache, False)  # ignore_mismatch=False: a cache from another GPU is refused
    if progress:
        config.progress_monitor = _progress_monitor()
    for p in plan.profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"TensorRT refused optimization profile '{p.name}' ({p.to_dict()['shapes']})")
    return config


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder (a crash leaves the old file whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_network_graph(src: Path, dst: Path) -> None:
    """Save the graph structure of ``src`` without its weights (the engine holds them) for I/O listing and inspect."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    for init in model.graph.initializer:
        del init.external_data[:]
        init.data_location = onnx.TensorProto.DEFAULT
        init.ClearField("raw_data")
    onnx.save(model, str(dst))


def _check_tensorrt(config: BuildConfig) -> None:
    require_tensorrt()


def _versions() -> dict[str, str]:
    require_tensorrt()
    return engine_fingerprint()


@register_build_backend("tensorrt", pass_target=lambda config: "tensorrt", available=_check_tensorrt,
                        versions=_versions)
def build_tensorrt(stage: StageDir, out: Path, config: BuildConfig) -> dict[str, str]:
    """Compile the stage's graph into ``decoder.engine`` plus ``tensorrt.json`` (version, GPU, profiles, precision)."""
    require_tensorrt()
    import tensorrt as trt

    fingerprint = engine_fingerprint()
    io = graph_io(stage.onnx_path)
    max_seq = config.max_seq_len_for(stage.geometry)
    plan = plan_profiles(io["inputs"], config.max_batch_size, max_seq, config.opt_batch_size, config.opt_seq_len)
    logger = trt.Logger(trt.Logger.WARNING)
    builder, network, _parser = parse_network(stage.onnx_path, logger)
    add_greedy_output(network)
    cache_path = Path(config.timing_cache) if config.timing_cache else default_timing_cache(fingerprint)
    cached = cache_path.read_bytes() if cache_path.is_file() else b""
    bconfig = builder_config(builder, plan, config.workspace_mib or DEFAULT_WORKSPACE_MIB, cached,
                             progress=log.getEffectiveLevel() <= logging.INFO)
    serialized = builder.build_serialized_network(network, bconfig)
    if serialized is None:  # TensorRT logged why through the logger
        raise BuildError("TensorRT could not build the engine (see the messages above); try a larger --workspace-mib "
                         "or smaller --max-batch-size / --max-seq-len")
    (out / ENGINE_NAME).write_bytes(bytes(serialized))
    _write_atomic(cache_path, bytes(bconfig.get_timing_cache().serialize()))
    write_network_graph(stage.onnx_path, out / NETWORK_NAME)
    info = {**fingerprint, "precision": config.precision, "strongly_typed": True, "profiles": plan.to_list(),
            "greedy_output": GREEDY_OUTPUT, "timing_cache": str(cache_path),
            "workspace_mib": config.workspace_mib or DEFAULT_WORKSPACE_MIB,
            "source_graph": f"{stage.path.name}/{ONNX_NAME}"}
    (out / INFO_NAME).write_text(json.dumps(info, indent=2))
    return {"decoder": ENGINE_NAME, "network": NETWORK_NAME, "tensorrt": INFO_NAME}
