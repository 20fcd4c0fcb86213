"""A Triton Inference Server model repository for an engine directory (``trtinfer triton DIR -o REPO``).

    decoder engine (onnxruntime or tensorrt) -> REPO/NAME/config.pbtxt   backend "python", decoupled
                                                REPO/NAME/1/model.py      (trtinfer/serving/triton_model.py)
                                                REPO/NAME/1/engine/       the engine directory (copy or symlink)
    encoder engine, onnxruntime              -> platform "onnxruntime_onnx", dynamic batching, 1/model.onnx(+.data)
    encoder engine, tensorrt                 -> platform "tensorrt_plan", dynamic batching, 1/model.plan

Decoders run the trtinfer runtime inside Triton's Python backend (which also drives TensorRT engines), one response
per text delta. Their inputs carry TensorRT-LLM's tensor names (``text_input``, ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``random_seed``, ``stop_words``, ``stream``, ...) and vLLM's ``sampling_parameters`` (a JSON
object of vLLM's ``SamplingParams`` names); the output is ``text_output``. :func:`parse_request` and
:func:`response_texts` are the whole request logic of the generated ``model.py``, so they are tested here, against
a real engine, without a Triton server.

``config.pbtxt`` files are ``model_config_pb2.ModelConfig`` messages from tritonclient, written with protobuf's
text format: a field Triton does not know cannot be written. tritonclient is needed to write a repository, not to
serve one (``pip install "trtinfer[triton]"``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer._outputs import atomic_dir
from trtinfer.artifact import GraphIO, Manifest, read_manifest
from trtinfer.errors import BackendUnavailableError, ConfigError, EngineLoadError, InputError
from trtinfer.runtime.config import PROVIDERS, GenerationConfig
from trtinfer.serving.config import check_ints
from trtinfer.serving.sampling import VLLM_FIELDS, sampling_fields

log = logging.getLogger(__name__)

CONFIG_NAME = "config.pbtxt"
ENGINE_FOLDER = "engine"  # the engine directory inside a decoder's version folder
MODEL_SOURCE = Path(__file__).with_name("triton_model.py")  # written as the version folder's model.py

#: A decoder's request tensors: name -> (Triton data type, dims); all optional except ``text_input``.
DECODER_INPUTS: dict[str, tuple[str, list[int]]] = {
    "text_input": ("TYPE_STRING", [1]), "max_tokens": ("TYPE_INT32", [1]), "min_tokens": ("TYPE_INT32", [1]),
    "temperature": ("TYPE_FP32", [1]), "top_p": ("TYPE_FP32", [1]), "top_k": ("TYPE_INT32", [1]),
    "min_p": ("TYPE_FP32", [1]), "repetition_penalty": ("TYPE_FP32", [1]), "presence_penalty": ("TYPE_FP32", [1]),
    "frequency_penalty": ("TYPE_FP32", [1]), "random_seed": ("TYPE_UINT64", [1]), "stop_words": ("TYPE_STRING", [-1]),
    "stream": ("TYPE_BOOL", [1]), "sampling_parameters": ("TYPE_STRING", [1]),
}
INPUT_NAMES = tuple(DECODER_INPUTS)

# request tensor -> the vLLM sampling parameter it sets (stop_words, a list, is read apart)
_TENSOR_PARAMS = {**{k: k for k in VLLM_FIELDS if k in DECODER_INPUTS}, "random_seed": "seed"}

_TRITON_TYPES = {"bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "int8": "TYPE_INT8", "int16": "TYPE_INT16",
                 "int32": "TYPE_INT32", "int64": "TYPE_INT64", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16",
                 "float32": "TYPE_FP32", "float64": "TYPE_FP64", "string": "TYPE_STRING"}


@dataclass(frozen=True)
class TritonConfig:
    """How ``trtinfer triton`` lays out the model repository.

    ``model_name``: the model's folder and name in Triton (default: the engine directory's name, with characters
    other than letters, digits, ``_``, ``-`` and ``.`` replaced by ``_``). ``version``: the version folder.
    ``link``: symlink the engine files instead of copying them (the repository then depends on the engine
    directory staying where it is). ``instances``: Triton model instances (each loads the engine once).
    ``provider``: the decoder's execution provider in Triton (default: ``cuda`` for engines built for CUDA, else
    ``cpu``). ``max_queue_delay_us``: how long an encoder's dynamic batcher waits to fill a batch.
    """

    model_name: str | None = None
    version: int = 1
    link: bool = False
    instances: int = 1
    provider: str | None = None
    max_queue_delay_us: int = 100

    def __post_init__(self) -> None:
        if self.model_name is not None and not re.fullmatch(r"(?!\.+$)[A-Za-z0-9_.-]+", self.model_name or ""):
            raise ConfigError(f"model_name must be letters, digits, '_', '-' or '.' and not only dots (a folder of "
                              f"the repository), got {self.model_name!r}", field="model_name")
        check_ints(self, {"version": 1, "instances": 1, "max_queue_delay_us": 0})
        if self.provider is not None and self.provider not in PROVIDERS:
            raise ConfigError(f"provider must be one of {', '.join(PROVIDERS)}, got {self.provider!r}", field="provider")


def _pb2() -> Any:
    """tritonclient's ``model_config_pb2``, or a one-line error saying what to install."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise BackendUnavailableError(
            'writing a Triton model repository needs tritonclient: pip install "trtinfer[triton]"') from e
    return model_config_pb2


# --- config.pbtxt -----------------------------------------------------------------------------------------------
def _triton_type(dtype: str, where: str) -> str:
    if dtype not in _TRITON_TYPES:
        raise EngineLoadError(f"{where} has element type {dtype!r}, which has no Triton type; known: "
                              f"{', '.join(_TRITON_TYPES)}")
    return _TRITON_TYPES[dtype]


def _dims(shape: list[Any]) -> list[int]:
    """Manifest dims (ints or names of dynamic axes) -> Triton dims (-1 for dynamic)."""
    return [d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else -1 for d in shape]


def _batched(io: GraphIO) -> bool:
    """True if every input and output has a dynamic first axis (Triton's batch dimension)."""
    specs = io.inputs + io.outputs
    return bool(specs) and all(s.shape and _dims(list(s.shape[:1])) == [-1] for s in specs)


def decoder_config(manifest: Manifest, name: str, config: TritonConfig) -> Any:
    """The ``ModelConfig`` of a decoder: Python backend, decoupled (one response per text delta), no batching."""
    pb2 = _pb2()
    provider = config.provider or ("cuda" if manifest.backend == "onnxruntime" and manifest.target == "cuda" else "cpu")
    gpu = provider != "cpu" or manifest.backend == "tensorrt"
    msg = pb2.ModelConfig(name=name, backend="python", max_batch_size=0, model_transaction_policy={"decoupled": True},
                          parameters={"provider": {"string_value": provider},
                                      "engine_backend": {"string_value": manifest.backend}})
    for tname, (dtype, dims) in DECODER_INPUTS.items():
        msg.input.add(name=tname, data_type=dtype, dims=dims, optional=tname != "text_input")
    msg.output.add(name="text_output", data_type="TYPE_STRING", dims=[-1])  # its one output: the text
    msg.instance_group.add(count=config.instances, kind="KIND_GPU" if gpu else "KIND_CPU")
    return msg


def _encoder_config(manifest: Manifest, name: str, config: TritonConfig, platform: str, filename: str) -> Any:
    """An encoder's ``ModelConfig``: the graph served as is, inputs/outputs from the manifest's I/O listing."""
    pb2 = _pb2()
    io = manifest.io
    batched = _batched(io)
    msg = pb2.ModelConfig(name=name, platform=platform, default_model_filename=filename,
                          max_batch_size=manifest.max_batch_size if batched else 0)
    for key, field, specs in (("input", msg.input, io.inputs), ("output", msg.output, io.outputs)):
        for spec in specs:
            field.add(name=spec.name, data_type=_triton_type(spec.dtype, f"the engine's {key} {spec.name}"),
                      dims=_dims(list(spec.shape))[1 if batched else 0:])
    if batched:
        msg.dynamic_batching.max_queue_delay_microseconds = config.max_queue_delay_us
    gpu = platform == "tensorrt_plan" or manifest.target == "cuda"
    msg.instance_group.add(count=config.instances, kind="KIND_GPU" if gpu else "KIND_CPU")
    return msg


def config_text(msg: Any) -> str:
    """``msg`` in protobuf text format, checked by parsing it back into a ``ModelConfig``."""
    from google.protobuf import text_format

    text = str(text_format.MessageToString(msg))
    back = text_format.Parse(text, _pb2().ModelConfig())
    if back != msg:  # cannot happen for a message built from the schema; a cheap guard against a broken writer
        raise EngineLoadError(f"the config of model {msg.name} did not survive a text-format round trip")
    return text


# --- the models, one writer per engine kind and backend ----------------------------------------------------------
def _place(src: Path, dst: Path, link: bool) -> None:
    """Copy ``src`` (a file or folder) to ``dst``, or symlink it (absolute) with ``link``."""
    if link:
        dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=False)
    else:
        shutil.copy2(src, dst)


def _python_model(engine_dir: Path, manifest: Manifest, name: str, config: TritonConfig, version: Path) -> Any:
    shutil.copy2(MODEL_SOURCE, version / "model.py")
    _place(engine_dir, version / ENGINE_FOLDER, config.link)
    return decoder_config(manifest, name, config)


def _graph_model(platform: str, filename: str, data_role: str | None) -> Callable[..., Any]:
    def write(engine_dir: Path, manifest: Manifest, name: str, config: TritonConfig, version: Path) -> Any:
        _place(engine_dir / manifest.files["encoder"], version / filename, config.link)
        data = manifest.files.get(data_role) if data_role else None
        if data:  # external weights: the graph refers to them by this file name, next to it
            _place(engine_dir / data, version / data, config.link)
        return _encoder_config(manifest, name, config, platform, filename)

    return write


#: (engine kind, engine backend) -> writer of the model folder; returns the model's ModelConfig.
MODEL_FORMS: dict[tuple[str, str], Callable[..., Any]] = {
    ("decoder", "onnxruntime"): _python_model,
    ("decoder", "tensorrt"): _python_model,  # the trtinfer runtime drives TensorRT inside the Python backend
    ("encoder", "onnxruntime"): _graph_model("onnxruntime_onnx", "model.onnx", "encoder_data"),
    ("encoder", "tensorrt"): _graph_model("tensorrt_plan", "model.plan", None),
}


def default_model_name(engine_dir: Path) -> str:
    """The engine directory's name as a Triton model name (other characters become ``_``)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(engine_dir).resolve().name)
    return "model" if not name.strip(".") else name


def write_repository(engine_dir: str | Path, repo_dir: str | Path, config: TritonConfig | None = None, *,
                     overwrite: bool = False) -> Path:
    """Write a Triton model repository serving ``engine_dir`` at ``repo_dir``; returns the model's folder.

    The repository appears whole or not at all (written beside ``repo_dir``, renamed at the end); an existing
    ``repo_dir`` is an error unless ``overwrite``.
    """
    config = config or TritonConfig()
    engine_dir = Path(engine_dir)
    _pb2()  # before any work: a missing tritonclient is the first thing to say
    manifest = read_manifest(engine_dir)
    form = (manifest.kind, manifest.backend)
    if form not in MODEL_FORMS:
        known = ", ".join(f"{k} on {b}" for k, b in MODEL_FORMS)
        raise EngineLoadError(f"{engine_dir} is a {form[0]} engine on {form[1]}; Triton repositories are written for: "
                              f"{known}")
    name = config.model_name or default_model_name(engine_dir)
    repo = Path(repo_dir)
    with atomic_dir(repo, overwrite=overwrite, inputs=(engine_dir,), copies_inputs=True) as tmp:
        (tmp / name / str(config.version)).mkdir(parents=True)
        msg = MODEL_FORMS[form](engine_dir, manifest, name, config, tmp / name / str(config.version))
        (tmp / name / CONFIG_NAME).write_text(config_text(msg))
    kind = "python backend, decoupled" if msg.backend == "python" else msg.platform
    log.debug("wrote Triton model %s (%s) to %s", name, kind, repo)
    return repo / name


# --- request handling of the generated model.py -----------------------------------------------------------------
@dataclass(frozen=True)
class TritonRequest:
    """One decoder request: the prompt, its generation settings and whether to stream the text."""

    prompt: str
    config: GenerationConfig
    stream: bool = True


def _text(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"input {name} is not UTF-8 text (byte 0x{raw[e.start]:02x} at {e.start}); send UTF-8") from e


def _scalar(name: str, value: np.ndarray) -> Any:
    arr = np.asarray(value).reshape(-1)
    if arr.size != 1:
        raise InputError(f"input {name} should hold one value, found {arr.size}")
    item = arr[0]
    return _text(name, item) if isinstance(item, bytes) else item.item() if hasattr(item, "item") else item


def _strings(name: str, value: np.ndarray) -> tuple[str, ...]:
    return tuple(_text(name, v) if isinstance(v, bytes) else str(v) for v in np.asarray(value).reshape(-1))


def parse_request(inputs: Mapping[str, np.ndarray], defaults: GenerationConfig | None = None,
                  defaults_set: frozenset[str] = frozenset()) -> TritonRequest:
    """A decoder request's tensors (name -> numpy array, as Triton gives them) -> :class:`TritonRequest`.

    Settings left out keep ``defaults`` (the engine's ``generation_config.json``); ``sampling_parameters`` (vLLM's
    JSON) comes first and the single tensors override it. ``top_k`` 0 or -1 means no top-k; ``temperature`` 0 means
    greedy, above 0 sampling. Bad values raise :class:`InputError` / :class:`ConfigError`.
    """
    if unknown := sorted(set(inputs) - set(INPUT_NAMES)):
        raise InputError(f"unknown input(s) {unknown}; known: {list(INPUT_NAMES)}")
    if "text_input" not in inputs:
        raise InputError("input text_input is required (the prompt, a string)")
    prompt = _scalar("text_input", inputs["text_input"])
    if not isinstance(prompt, str):
        raise InputError(f"input text_input should be a string, found {type(prompt).__name__}")
    params: dict[str, Any] = {}
    if "sampling_parameters" in inputs:
        raw = _scalar("sampling_parameters", inputs["sampling_parameters"])
        try:
            params = json.loads(raw)
        except (TypeError, ValueError) as e:
            raise InputError(f"input sampling_parameters should be a JSON object, found {str(raw)[:60]!r}") from e
        if not isinstance(params, dict):
            raise InputError(f"input sampling_parameters should be a JSON object, found {type(params).__name__}")
        if bad := sorted(set(params) - set(VLLM_FIELDS)):
            raise InputError(f"unknown sampling_parameters {bad}; known: {sorted(VLLM_FIELDS)}")
    params.update({param: _scalar(tname, inputs[tname]) for tname, param in _TENSOR_PARAMS.items() if tname in inputs})
    if "stop_words" in inputs:
        params["stop"] = _strings("stop_words", inputs["stop_words"])
    stream = bool(_scalar("stream", inputs["stream"])) if "stream" in inputs else True
    base = defaults or GenerationConfig()
    # one streamed sequence per request; top-k only where the model's generation_config.json (``defaults_set``) or
    # the request sets it (vLLM's rule; transformers' own default of 50 is not applied)
    base = dataclasses.replace(base, num_beams=1, num_return_sequences=1,
                               top_k=base.top_k if "top_k" in defaults_set else 0)
    return TritonRequest(prompt, dataclasses.replace(base, **sampling_fields(params)), stream)


def submit(scheduler: Any, request: TritonRequest) -> Any:
    """Queue a parsed request on the instance's :class:`~trtinfer.runtime.scheduler.Scheduler` (the prompt encoded
    as ``engine.generate`` encodes it, and as there a prompt near the model length gets the room left, ending with
    ``"length"``); the scheduler's request, to read with :func:`response_texts`."""
    return scheduler.submit(scheduler.tokenizer.encode(request.prompt), request.config, clip=True)


def response_texts(submitted: Any, stream: bool = True, cancelled: Callable[[], bool] | None = None) -> Iterator[str]:
    """The ``text_output`` of each response of a submitted request: every non-empty text delta when streaming, else
    the whole text once (blocking as the scheduler makes them; its error is raised). ``cancelled`` (Triton's
    ``response_sender.is_cancelled``) is asked at each token: once it says so, the request is cancelled (its slot
    frees at the scheduler's next step) and nothing more is given."""
    parts: list[str] = []
    for ev in submitted:
        if cancelled is not None and cancelled():
            submitted.cancel()
            return
        if ev.text and stream:
            yield ev.text
        elif ev.text:
            parts.append(ev.text)
    if not stream:
        yield "".join(parts)


def text_tensor(text: str) -> np.ndarray:
    """A ``text_output`` value: one UTF-8 string, as Triton's TYPE_STRING tensors hold it."""
    return np.array([text.encode("utf-8")], dtype=np.object_)
