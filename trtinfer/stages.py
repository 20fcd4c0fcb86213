"""Stage directories: what one stage (export, optimize) writes and the next one reads.

A stage directory holds the graph (``model.onnx`` + ``model.onnx.data``), the tokenizer files, ``reference.npz``
(the engine check's reference logits, computed once on the export that was validated against eager) and
``stage.json``. ``stage.json`` is the one source of truth for the model's facts, written once at export
(``architecture``, ``model_type``, ``source``, ``geometry``) and carried forward unchanged; for this stage's graph
(``io``, ``kv_layout``); for the tokenizer (``tokenizer``); for what each stage did (``history``: config, seconds,
validation or fusion report); and for the files themselves (``files``: size and sha256 of each), so a stage that
reads the directory can tell it is the one that was written and validated. The record itself (:class:`StageDir`,
:func:`~trtinfer.artifact.write_stage`, :func:`~trtinfer.artifact.read_stage`) lives in :mod:`trtinfer.artifact`
beside the engine manifest's; this module makes stages (atomically, or in the cache) and carries facts forward.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trtinfer._cache import cached_dir
from trtinfer._outputs import atomic_dir
from trtinfer.artifact import ONNX_NAME, REFERENCE_NAME, StageDir, read_stage

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
#: the facts the export writes once; later stages copy them unchanged
MODEL_FACTS = ("kind", "architecture", "model_type", "source", "geometry", "weights")


def default_max_seq_len(geometry: dict[str, Any]) -> int:
    """Positions an engine covers when not told: the model's ``max_position_embeddings``, capped at 4096."""
    return min(geometry.get("max_position_embeddings") or 4096, 4096)


def carry_forward(src: StageDir, dst: Path) -> dict[str, Any]:
    """Carry what the next stage needs besides the graph (tokenizer files, reference: hard links where possible, a
    Qwen3 tokenizer is 11 MB); return the inherited facts."""
    src.copy_files((*TOKENIZER_FILES, REFERENCE_NAME), dst, link=True)
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

    from trtinfer.version import __version__

    return {"trtinfer": __version__, **{n: version(n) for n in names}}


def make_stage(output_dir: str | Path, make: Callable[[Path], StageDir], *, overwrite: bool = False,
               source: str | Path | None = None) -> StageDir:
    """A stage written by ``make(tmp)`` into a temp folder beside ``output_dir``, renamed there at the end (nothing is
    left at ``output_dir`` if ``make`` fails); ``output_dir`` may not overlap ``source``, the stage's input."""
    out = Path(output_dir)
    with atomic_dir(out, overwrite=overwrite, inputs=() if source is None else (source,)) as tmp:
        done = make(tmp)
    return StageDir(out, done.info)


def cached_stage(kind: str, key: str, make: Callable[[Path], StageDir],
                 stats: dict[str, Any] | None = None) -> StageDir:
    """The stage of cache ``kind``/``key``, written by ``make(tmp)`` unless a checked entry is there already;
    ``stats["cached"]`` tells whether the entry was reused."""
    from trtinfer.stage_weights import reference_problem

    made = []
    path = cached_dir(kind, key, lambda tmp: made.append(make(tmp)),
                      stale=lambda entry: reference_problem(entry / ONNX_NAME))
    if stats is not None:
        stats["cached"] = not made
    return read_stage(path, verify=False)  # cached_dir has just checked the files
