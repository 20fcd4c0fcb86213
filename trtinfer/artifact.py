"""Artifact records, read, checked and written in one place: a stage directory's ``stage.json`` and an engine
directory's ``manifest.json``.

Both describe a graph by the same facts (kind, geometry, inputs/outputs, KV layout, tokenizer), typed once in
:class:`ArtifactRecord`, which :class:`StageDir` and :class:`Manifest` share, so no code outside this module indexes
the raw dicts. :func:`write_stage` / :func:`read_stage` (files recorded by size and sha256, checked on read) and
:func:`new_manifest` / :func:`write_manifest` / :func:`read_manifest` (structure checked on write and read) are
the only writers and readers. Stdlib only: the runtime imports it.
"""
from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from trtinfer._cache import check_files, key_of, record_files
from trtinfer.errors import EngineLoadError, ModelSourceError
from trtinfer.manifest_check import check_manifest, json_int, show

STAGE_FILE = "stage.json"
STAGE_FORMAT = 1
STAGES = ("export", "optimize", "quantize")
ONNX_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
REFERENCE_NAME = "reference.npz"


class KVLayoutKind(str, Enum):
    """How a graph keeps its KV cache (the manifest's and stage.json's ``kv_layout``)."""

    #: past and present are separate, growing tensors; left padding + ``attention_mask``
    CONCAT = "concat"
    #: ONNX Runtime GroupQueryAttention: past and present share one preallocated buffer; right padding + ``seqlens_k``
    SHARED_BUFFER = "shared_buffer"
    #: the ``tensorrt`` target: TensorScatter writes each step into a preallocated buffer at ``position_ids[:, 0]``;
    #: right padding, masks from ``position_ids``
    SCATTER_BUFFER = "scatter_buffer"


#: the layout names a record may hold
KV_LAYOUTS = tuple(k.value for k in KVLayoutKind)
KINDS = ("decoder", "encoder")
PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
#: element sizes of the dtypes a :class:`TensorSpec` may name (as :func:`trtinfer.stages.graph_io` writes them)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: its name, element type and shape (integers, or names of symbolic dimensions)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(str(d["name"]), str(d["dtype"]), tuple(d["shape"]))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphIO:
    """A graph's inputs and outputs, in graph order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraphIO:
        return cls(tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                   tuple(TensorSpec.from_dict(t) for t in d["outputs"]))

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def input(self, name: str) -> TensorSpec | None:
        """The input called ``name``, if the graph has one."""
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        """The output called ``name``, if the graph has one."""
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def past(self) -> list[TensorSpec]:
        """The KV cache inputs (``past_key_values.*``), in graph order."""
        return [t for t in self.inputs if t.name.startswith(PAST_PREFIX)]

    @property
    def kv_dtype(self) -> str:
        """Element type of the KV cache (``float32``, ``float16`` or ``bfloat16``)."""
        past = self.past
        return past[0].dtype if past else "float32"


class ArtifactRecord(ABC):
    """Typed accessors over an artifact's JSON record (``stage.json`` or ``manifest.json``)."""

    @property
    @abstractmethod
    def record(self) -> dict[str, Any]:
        """The parsed JSON object."""

    @property
    def kind(self) -> str:
        """``decoder`` or ``encoder``."""
        return str(self.record.get("kind", "decoder"))

    @property
    def geometry(self) -> dict[str, Any]:
        """Layers, heads, head dim, vocabulary, layer types and windows, as the exporter read them."""
        return dict(self.record["geometry"])

    @property
    def io(self) -> GraphIO:
        """The graph's inputs and outputs."""
        return GraphIO.from_dict(self.record["io"])

    @property
    def kv_layout(self) -> str:
        """The KV layout's name (a :class:`KVLayoutKind` value; ``concat`` when the record names none)."""
        return KVLayoutKind(self.record.get("kv_layout", KVLayoutKind.CONCAT.value)).value

    @property
    def tokenizer_info(self) -> dict[str, Any]:
        """BOS/EOS/pad tokens and ids (empty when the record has none)."""
        return dict(self.record.get("tokenizer") or {})

    @property
    def pad_token_id(self) -> int:
        """The padding id (0 when the tokenizer has none)."""
        return int(self.tokenizer_info.get("pad_token_id") or 0)

    @property
    def source(self) -> dict[str, Any]:
        """Where the weights came from (``path``, ``sha256``, ...)."""
        return dict(self.record.get("source") or {})


# --- stage directories ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageDir(ArtifactRecord):
    """A stage directory and its parsed ``stage.json`` (typed facts: :class:`~trtinfer.artifact.ArtifactRecord`)."""

    path: Path
    info: dict[str, Any]

    @property
    def record(self) -> dict[str, Any]:
        return self.info

    @property
    def stage(self) -> str:
        """``export``, ``optimize`` or ``quantize``."""
        return str(self.info["stage"])

    @property
    def onnx_path(self) -> Path:
        """The graph file."""
        return self.path / ONNX_NAME

    @property
    def history(self) -> dict[str, Any]:
        """Per stage so far: its config, seconds and report."""
        return dict(self.info.get("history", {}))

    @property
    def validation(self) -> dict[str, Any] | None:
        """The export's comparison with PyTorch eager (None if it was skipped)."""
        return self.history.get("export", {}).get("validation")

    @property
    def reference_path(self) -> Path | None:
        """The engine check's reference logits, if the export computed them."""
        p = self.path / REFERENCE_NAME
        return p if REFERENCE_NAME in self.info.get("files", {}) else None

    def copy_files(self, names: tuple[str, ...], dst: Path, *, link: bool = False) -> None:
        """Copy those of ``names`` this stage holds into ``dst``; with ``link``, hard-link them where the file system
        allows (one copy on disk for every stage of a chain: a stage's files are never written after it records
        them, and :func:`read_stage` refuses one that changed). An engine's files are copies: users edit them."""
        for name in names:
            if name not in self.info["files"]:
                continue
            if link:
                try:
                    os.link(self.path / name, dst / name)
                    continue
                except OSError:  # another file system, or one without hard links
                    pass
            shutil.copyfile(self.path / name, dst / name)

    def content_key(self) -> str:
        """A key for everything this directory holds (its files' hashes and its stage.json facts)."""
        files = {n: r["sha256"] for n, r in self.info["files"].items()}
        facts = {k: v for k, v in self.info.items() if k not in ("files", "history", "source")}
        # what each stage did matters; how long it (or any pass of it) took and where the model was read from do not:
        # a stage made again from the same input must key the next stage's cache entry the same
        return key_of([files, facts, _untimed(self.history), self.info.get("source", {}).get("sha256")])


def _untimed(record: Any) -> Any:
    """``record`` without its ``seconds`` entries, at any depth."""
    if isinstance(record, dict):
        return {k: _untimed(v) for k, v in record.items() if k != "seconds"}
    if isinstance(record, list):
        return [_untimed(v) for v in record]
    return record


def write_stage(folder: Path, info: dict[str, Any]) -> StageDir:
    """Record every file in ``folder`` (size, sha256) and write ``stage.json``; returns the stage."""
    info = {**info, "format": STAGE_FORMAT}
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != STAGE_FILE)
    info["files"] = record_files(folder, names)
    (folder / STAGE_FILE).write_text(json.dumps(info, indent=2))
    return StageDir(folder, info)


def is_stage_dir(path: str | Path) -> bool:
    """True if ``path`` is a folder holding a ``stage.json``."""
    return (Path(path) / STAGE_FILE).is_file()


def read_stage(path: str | Path, *, verify: bool = True) -> StageDir:
    """Read a stage directory; with ``verify``, check its files against their record (size, then sha256).

    A file that changed after the stage wrote it is an error: validation figures and fusion reports describe the
    files as written, so a modified folder must be produced again.
    """
    folder = Path(path)
    file = folder / STAGE_FILE
    try:
        info = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise ModelSourceError(f"{folder} has no {STAGE_FILE}: not a trtinfer export or optimize output") from e
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"{file} is unreadable ({e}); produce {folder} again") from e
    if not isinstance(info, dict) or info.get("stage") not in STAGES or not isinstance(info.get("files"), dict):
        raise ModelSourceError(f"{file} is not a trtinfer stage record; produce {folder} again")
    shape = {"geometry": dict, "io": dict, "history": dict, "architecture": str}
    bad = [k for k, t in shape.items() if not isinstance(info.get(k), t)]
    bad += [f"files.{n}" for n, r in info["files"].items() if not isinstance(r, dict) or not {"size", "sha256"} <= set(r)]
    if info.get("kv_layout", KVLayoutKind.CONCAT.value) not in KV_LAYOUTS:
        bad.append("kv_layout")
    io = info.get("io")
    specs = [*io.get("inputs", ()), *io.get("outputs", ())] if isinstance(io, dict) else []
    if not (isinstance(io, dict) and all(isinstance(io.get(k), list) for k in ("inputs", "outputs")) and all(
            isinstance(t, dict) and {"name", "dtype", "shape"} <= set(t) for t in specs)):
        bad.append("io")
    for done in ("optimize", "quantize")[:STAGES.index(info["stage"])]:
        if not isinstance(info.get("history", {}).get(done, {}).get("config"), dict):
            bad.append(f"history.{done}.config")
    if bad:
        raise ModelSourceError(f"{file} lacks or mistypes {', '.join(bad)}; produce {folder} again")
    if info.get("format") != STAGE_FORMAT:
        raise ModelSourceError(f"{file} has format {info.get('format')}, this trtinfer reads {STAGE_FORMAT}; "
                               f"produce {folder} again with this version")
    if verify:
        problem = check_files(folder, info["files"])
        if problem:
            raise ModelSourceError(f"{folder} was modified after `trtinfer {info['stage']}` wrote it ({problem}); "
                                   f"run `trtinfer {info['stage']}` again")
    return StageDir(folder, info)


# --- engine manifests -----------------------------------------------------------------------------------------
MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest(ArtifactRecord):
    """A parsed, checked manifest: typed accessors (:class:`~trtinfer.artifact.ArtifactRecord`'s kind, geometry, io,
    kv_layout, tokenizer, and the build's own below); :meth:`to_dict` gives every field (``inspect``)."""

    raw: dict[str, Any]

    @property
    def record(self) -> dict[str, Any]:
        return self.raw

    @classmethod
    def of_stage(cls, stage: ArtifactRecord, decoder_file: str, max_seq_len: int) -> Manifest:
        """A stage directory's graph read as a batch-1 engine (scoring a stage): the stage record's own facts,
        without a build record."""
        return cls({"manifest_version": MANIFEST_VERSION, "backend": "onnxruntime", "kind": stage.kind,
                    "geometry": stage.geometry, "io": stage.io.to_dict(), "kv_layout": stage.kv_layout,
                    "files": {"decoder": decoder_file}, "tokenizer": stage.tokenizer_info,
                    "limits": {"max_batch_size": 1, "max_seq_len": max_seq_len}})

    def updated(self, **fields: Any) -> Manifest:
        """This manifest with ``fields`` set (a build adding its checks and timings)."""
        return Manifest({**self.raw, **fields})

    def to_dict(self) -> dict[str, Any]:
        """Every field, as a new JSON-friendly dict."""
        return json.loads(json.dumps(self.raw))  # type: ignore[no-any-return]

    @property
    def backend(self) -> str:
        """Backend name (``onnxruntime`` or ``tensorrt``)."""
        return str(self.raw["backend"])

    @property
    def target(self) -> str:
        """The build target (``cpu``, ``cuda``, ``tensorrt``; ``cpu`` when not recorded)."""
        return str(self.raw.get("target") or "cpu")

    @property
    def precision(self) -> str:
        """The engine's precision (``fp32``, ``fp16``, ``bf16``, ``int4``, ...): the manifest's, or, for a stage
        opened for scoring (no build record), what its KV type says."""
        if "precision" in self.raw:
            return str(self.raw["precision"])
        return {"float16": "fp16", "bfloat16": "bf16"}.get(self.io.kv_dtype, "fp32")

    @property
    def export_logits(self) -> str | None:
        """The export's ``logits`` mode (``last`` or ``all``), None where the manifest records no export (a stage
        opened for scoring): the built graph's logits shape may not say it (ONNX Runtime's offline optimization can
        turn the last-position graph's literal 1 into a named dimension)."""
        mode = ((self.raw.get("export") or {}).get("config") or {}).get("logits")
        return None if mode is None else str(mode)

    @property
    def kept_float(self) -> tuple[str, ...]:
        """Node-name patterns a quantized engine's build left unquantized (``keep_fp32`` + ``exclude``); empty for
        an engine without quantization or with every GEMM quantized."""
        cfg = (self.raw.get("quantization") or {}).get("config") or {}
        return tuple(cfg.get("keep_fp32") or ()) + tuple(cfg.get("exclude") or ())

    @property
    def pooling(self) -> dict[str, Any]:
        """An encoder's pooling (``mode``, ``normalize``); mean without normalization when not recorded."""
        return dict(self.raw.get("pooling") or {"mode": "mean", "normalize": False})

    @property
    def tensorrt(self) -> dict[str, Any]:
        """A TensorRT engine's build record (profiles, versions, device); empty for ONNX Runtime engines."""
        return dict(self.raw.get("tensorrt") or {})

    @property
    def max_batch_size(self) -> int:
        """Largest batch the engine accepts."""
        return int(self.raw["limits"]["max_batch_size"])

    @property
    def max_seq_len(self) -> int:
        """Largest prompt + generated length."""
        return int(self.raw["limits"]["max_seq_len"])

    @property
    def files(self) -> dict[str, str]:
        """Role -> file name inside the engine directory."""
        return dict(self.raw["files"])


def new_manifest(model: ArtifactRecord, *, kind: str, backend: str, precision: str, target: str, max_batch_size: int,
                 max_seq_len: int, io: dict[str, Any], files: dict[str, str], tokenizer: dict[str, Any],
                 kv_layout: str | None = None, **record: Any) -> Manifest:
    """The one constructor of engine manifests (the builders call it): the model's facts from its stage record
    (architecture, model type, source, geometry), the engine's typed facts, then the build's own record
    (``record``: export, build config, histograms, checks, ...); checked as :func:`read_manifest` checks one."""
    raw: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION, "kind": kind, "backend": backend, "precision": precision,
        "target": target, **{k: model.record[k] for k in ("architecture", "model_type", "source") if k in model.record},
        "geometry": model.geometry, "limits": {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len},
        "io": io, **({} if kv_layout is None else {"kv_layout": KVLayoutKind(kv_layout).value}), "files": files,
        "tokenizer": tokenizer, **record}
    typed = {"manifest_version", "kind", "backend", "precision", "target", "geometry", "limits", "io", "kv_layout",
             "files", "tokenizer"}
    if typed & set(record):
        raise TypeError(f"new_manifest: {sorted(typed & set(record))} are typed arguments, not record fields")
    check_manifest(Path(f"the new {kind} manifest"), raw, KINDS, KV_LAYOUTS)
    return Manifest(raw)


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """``folder/manifest.json`` written from ``manifest``; its path."""
    path = Path(folder) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.raw, indent=2))
    return path


def kv_dtype(io: dict[str, Any]) -> str:
    """Element type of the KV cache (``float32``, ``float16`` or ``bfloat16``) from a graph's I/O listing."""
    return GraphIO.from_dict(io).kv_dtype


def read_manifest(engine_dir: Path) -> Manifest:
    """Read and check ``engine_dir/manifest.json``: its structure, its types and that its files are present."""
    path = Path(engine_dir) / MANIFEST_NAME
    if not Path(engine_dir).is_dir():
        there = "is a file, not an engine directory" if Path(engine_dir).exists() else "does not exist"
        raise EngineLoadError(f"engine directory {engine_dir} {there}; build one with `trtinfer build`")
    if not path.is_file():
        raise EngineLoadError(f"{engine_dir} has no {MANIFEST_NAME}: not an engine directory (build one with `trtinfer build`)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise EngineLoadError(f"{path} could not be read ({e}); check its permissions") from e
    try:
        raw = json.loads(data)
    except ValueError as e:  # bytes that are not UTF-8 too (UnicodeDecodeError)
        raise EngineLoadError(f"{path} is not valid JSON ({e}); rebuild the engine") from e
    if not isinstance(raw, dict):
        raise EngineLoadError(f"{path} should hold a JSON object, found {show(raw)}; rebuild the engine")
    version = raw.get("manifest_version")
    if not json_int(version) or version != MANIFEST_VERSION:
        raise EngineLoadError(
            f"{path} has manifest version {version}, this trtinfer reads {MANIFEST_VERSION}; rebuild the engine"
        )
    for key in ("backend", "geometry", "limits", "files", "io"):
        if key not in raw:
            raise EngineLoadError(f"{path} lacks '{key}'; rebuild the engine")
    check_manifest(path, raw, KINDS, KV_LAYOUTS)
    for role, name in raw["files"].items():
        if not (Path(engine_dir) / name).is_file():
            raise EngineLoadError(f"engine file {name} ({role}) is missing from {engine_dir}; rebuild the engine")
    return Manifest(raw)
