"""Stage directories: what one stage (export, optimize) writes and the next one reads.

A stage directory holds the graph (``model.onnx`` + ``model.onnx.data``), the tokenizer files, ``reference.npz``
(the engine check's reference logits, computed once on the export that was validated against eager) and
``stage.json``. ``stage.json`` is the one source of truth for the model's facts, written once at export
(``architecture``, ``model_type``, ``source``, ``geometry``) and carried forward unchanged; for this stage's graph
(``io``, ``kv_layout``); for the tokenizer (``tokenizer``); for what each stage did (``history``: config, seconds,
validation or fusion report); and for the files themselves (``files``: size and sha256 of each), so a stage that
reads the directory can tell it is the one that was written and validated.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtinfer._cache import atomic_dir, cached_dir, check_files, key_of, record_files
from trtinfer.artifact import ArtifactRecord
from trtinfer.errors import ModelSourceError

STAGE_FILE = "stage.json"
STAGE_FORMAT = 1
STAGES = ("export", "optimize", "quantize")
ONNX_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
REFERENCE_NAME = "reference.npz"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
#: the facts the export writes once; later stages copy them unchanged
MODEL_FACTS = ("kind", "architecture", "model_type", "source", "geometry", "weights")


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

    def copy_files(self, names: tuple[str, ...], dst: Path) -> None:
        """Copy those of ``names`` this stage holds into ``dst``."""
        for name in names:
            if name in self.info["files"]:
                shutil.copyfile(self.path / name, dst / name)

    def content_key(self) -> str:
        """A key for everything this directory holds (its files' hashes and its stage.json facts)."""
        files = {n: r["sha256"] for n, r in self.info["files"].items()}
        facts = {k: v for k, v in self.info.items() if k not in ("files", "history", "source")}
        # what each stage did matters, how long it took and where the model was read from do not
        done = {stage: {k: v for k, v in rec.items() if k != "seconds"} for stage, rec in self.history.items()}
        return key_of([files, facts, done, self.info.get("source", {}).get("sha256")])


def default_max_seq_len(geometry: dict[str, Any]) -> int:
    """Positions an engine covers when not told: the model's ``max_position_embeddings``, capped at 4096."""
    return min(geometry.get("max_position_embeddings") or 4096, 4096)


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


def carry_forward(src: StageDir, dst: Path) -> dict[str, Any]:
    """Copy what the next stage needs besides the graph (tokenizer files, reference); return the inherited facts."""
    src.copy_files((*TOKENIZER_FILES, REFERENCE_NAME), dst)
    inherited = {k: src.info[k] for k in MODEL_FACTS if k in src.info}
    inherited["tokenizer"] = src.info.get("tokenizer", {})
    inherited["history"] = src.history
    return inherited


ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64"}


def graph_io(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Names, dtypes and shapes (symbolic names or ints) of an ONNX file's inputs and outputs (weights not read)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def spec(vi: Any) -> dict[str, Any]:
        t = vi.type.tensor_type
        dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]
        return {"name": vi.name, "dtype": ONNX_DTYPES.get(t.elem_type, str(t.elem_type)), "shape": dims}

    from trtinfer.stage_weights import checkpoint_inputs

    inits = {i.name for i in model.graph.initializer} | checkpoint_inputs(model)  # weights are not inputs to feed
    return {"inputs": [spec(v) for v in model.graph.input if v.name not in inits],
            "outputs": [spec(v) for v in model.graph.output]}


def package_versions(*names: str) -> dict[str, str]:
    """trtinfer's version and those of ``names`` (from package metadata: nothing is imported)."""
    from importlib.metadata import version

    from trtinfer import __version__

    return {"trtinfer": __version__, **{n: version(n) for n in names}}


def make_stage(output_dir: str | Path, make: Callable[[Path], StageDir], *, overwrite: bool = False) -> StageDir:
    """A stage written by ``make(tmp)`` into a temp folder beside ``output_dir``, renamed there at the end (nothing is
    left at ``output_dir`` if ``make`` fails)."""
    out = Path(output_dir)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        done = make(tmp)
    return StageDir(out, done.info)


def cached_stage(kind: str, key: str, make: Callable[[Path], StageDir],
                 stats: dict[str, Any] | None = None) -> StageDir:
    """The stage of cache ``kind``/``key``, written by ``make(tmp)`` unless a checked entry is there already;
    ``stats["cached"]`` tells whether the entry was reused."""
    made = []
    path = cached_dir(kind, key, lambda tmp: made.append(make(tmp)))
    if stats is not None:
        stats["cached"] = not made
    return read_stage(path, verify=False)  # cached_dir has just checked the files
