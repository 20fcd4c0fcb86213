"""Stage graphs whose weights stay in the source checkpoint until a stage changes them.

An export writes no copy of the model's weights: every weight the graph reads as stored (norm gains, the
embedding table) or as a Linear's ``W.T`` is a graph input, and the graph's metadata (``trtinfer.checkpoint``)
says which safetensors tensor it is, whether it is transposed, and the checkpoint's folder and shard stamps (size,
mtime). The optimize stage keeps what its passes did not change the same way. A quantize stage reads each weight
when it quantizes it and writes only what it made (nothing there refers to the checkpoint), so the cache holds one
packed model, not an fp32 export and an fp32 optimized copy beside it (64 GB at the Qwen3-8B shape).

    load_graph(path)        the graph, each checkpoint weight an initializer read lazily (:class:`CheckpointTensor`)
    save_graph(model, path) references kept (export, optimize) or written out (quantize, materialized copies)
    materialized(stage)     a whole, ONNX Runtime-readable copy for the few runs that need one (validation,
                            calibration, the fp32 side of the accuracy report, an fp32 engine's compilation)

A checkpoint changed or moved after the export is one clear error when a weight is read, never wrong numbers.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from trtinfer._outputs import final_name, scratch_dir
from trtinfer.artifact import DATA_NAME, ONNX_NAME, STAGE_FILE, StageDir
from trtinfer.checkpoint import Checkpoint, to_float32
from trtinfer.errors import ModelSourceError, TrtInferError

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "trtinfer.checkpoint"  # graph metadata: {"folder", "shards": {file: [size, mtime_ns]}, "weights"}
CHECKPOINT_COUNT = "checkpoint_weights"  # stage.json: how many weights the stage's graph reads from its checkpoint
BLOCK_BYTES = 64 * 2**20  # float32 bytes widened (and transposed) at a time
TILE = 256  # rows and columns of a tile transposed at a time (:func:`transposed_block`)
ALIGN = 64 * 1024  # ONNX Runtime maps external data at offsets aligned to the allocation granularity


def shard_stamps(ckpt: Checkpoint) -> dict[str, list[int]]:
    """Size and mtime of each shard a checkpoint's tensors live in (what tells a later stage it is unchanged)."""
    out = {}
    for shard in sorted({t.shard for t in ckpt.tensors.values()}):
        st = shard.stat()
        out[shard.name] = [st.st_size, st.st_mtime_ns]
    return out


def transposed_block(words: np.ndarray, start: int, stop: int, dtype: str,
                     out: np.ndarray | None = None) -> np.ndarray:
    """float32 ``W[:, start:stop].T`` of stored words ``W [rows, cols]``, copied tile by tile: a tall table's narrow
    column block (a 262k-row embedding read as the LM head's ``W.T``) transposed whole walks the map one cache
    line per row; in tiles of :data:`TILE` rows x columns each source line is read once (Gemma-3's 671 MB table:
    2.3 -> 0.4 s)."""
    rows = words.shape[0]
    out = np.empty((stop - start, rows), np.float32) if out is None else out
    for c in range(start, stop, TILE):
        c1 = min(c + TILE, stop)
        for r in range(0, rows, TILE):
            out[c - start:c1 - start, r:r + TILE] = to_float32(words[r:r + TILE, c:c1], dtype).T
    return out


class CheckpointTensor(ir.LazyTensor):
    """A float32 weight read from a checkpoint tensor when asked for (``transpose``: the tensor's ``W.T``).

    Written to a file block by block (:meth:`tofile`), so materializing a model never holds more than one block
    beyond the mapped shard pages, which are released after each tensor.
    """

    def __init__(self, ckpt: Checkpoint, tensor: str, transpose: bool, name: str, rows: int | None = None) -> None:
        stored = ckpt.tensors[tensor].shape
        stored = (rows, *stored[1:]) if rows else stored
        shape = tuple(reversed(stored)) if transpose else stored
        super().__init__(self._read, dtype=ir.DataType.FLOAT, shape=ir.Shape(list(shape)), name=name)
        self.ckpt, self.tensor, self.transpose, self.rows_used = ckpt, tensor, transpose, rows

    def _words(self) -> np.ndarray:
        """The stored words this weight reads (its leading ``rows_used`` rows of a cut vocabulary), mapped."""
        words = self.ckpt.raw(self.tensor)
        return words[:self.rows_used] if self.rows_used else words

    def _blocks(self, out: np.ndarray | None = None) -> Iterator[np.ndarray]:
        """The float32 value in contiguous pieces, in file order (with ``out``, each piece is written into it and
        the pieces are views of it)."""
        info = self.ckpt.tensors[self.tensor]
        words = self._words()  # unmapped when this generator ends (its last reference goes)
        if self.transpose:
            rows, cols = words.shape  # W.T [cols, rows]: a block of W's columns at a time
            step = max(1, BLOCK_BYTES // (4 * rows))
            for c in range(0, cols, step):
                c1 = min(c + step, cols)
                yield transposed_block(words, c, c1, info.dtype, None if out is None else out[c:c1])
        else:  # widened a block at a time: a bf16 table's whole uint32 widening would double the peak
            flat, step = words.reshape(-1), BLOCK_BYTES // 4
            dest = None if out is None else out.reshape(-1)
            for i in range(0, flat.size, step):
                block = to_float32(flat[i:i + step], info.dtype)
                if dest is not None:
                    dest[i:i + step] = block
                    block = dest[i:i + step]
                yield block
        self.ckpt.release()

    def _stored(self, index: Any) -> np.ndarray:
        """float32 of ``stored[index]`` (the tensor as the checkpoint holds it), through a map dropped after."""
        info = self.ckpt.tensors[self.tensor]
        value = to_float32(self._words()[index], info.dtype)
        return np.array(value, order="C") if self.ckpt.viewed(self.tensor) else np.ascontiguousarray(value)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the float32 value (2-D)."""
        return self._stored((slice(None), slice(start, stop))).T if self.transpose else self._stored(
            slice(start, stop))

    def columns(self, start: int, stop: int) -> np.ndarray:
        """Columns ``start:stop`` of the float32 value (2-D); a transposed weight reads contiguous stored rows."""
        return self._stored(slice(start, stop)).T if self.transpose else self._stored(
            (slice(None), slice(start, stop)))

    def _read(self) -> ir.Tensor:
        out = np.empty(tuple(self.shape.numpy()), np.float32)
        for _ in self._blocks(out):
            pass
        return ir.Tensor(out, name=self.name)

    def tofile(self, file: Any) -> None:
        """Write the float32 bytes block by block."""
        for block in self._blocks():
            block.tofile(file)

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape.numpy(), dtype=np.int64))


def reference_record(ckpt: Checkpoint, weights: dict[str, tuple[str, bool, int | None]]) -> str:
    """The ``trtinfer.checkpoint`` metadata of a graph reading ``weights`` ({input: (tensor, transposed, rows)};
    ``rows``: the leading rows used, for a cut vocabulary, else None)."""
    return json.dumps({"folder": str(ckpt.folder.resolve()), "shards": shard_stamps(ckpt),
                       "weights": {k: {"tensor": t, "transpose": tr, **({"rows": r} if r else {})}
                                   for k, (t, tr, r) in sorted(weights.items())}})


def checkpoint_inputs(proto_or_props: Any) -> set[str]:
    """Names of the graph inputs a graph reads from its checkpoint (from an ONNX ModelProto's metadata)."""
    props = {p.key: p.value for p in proto_or_props.metadata_props}
    return set(json.loads(props[CHECKPOINT_KEY])["weights"]) if CHECKPOINT_KEY in props else set()


def _checkpoint_state(record: dict[str, Any], where: Path | str) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint a graph's ``trtinfer.checkpoint`` record names, or None and why it can no longer be read."""
    folder = Path(record["folder"])
    try:
        ckpt = Checkpoint(folder)
        stamps = shard_stamps(ckpt)
    except (ModelSourceError, OSError) as e:
        return None, f"{where} reads its weights from {folder}, which cannot be read now ({e})"
    changed = sorted(k for k in set(stamps) | set(record["shards"]) if stamps.get(k) != record["shards"].get(k))
    if changed:
        return None, f"{where} reads its weights from {folder}, whose {', '.join(changed[:3])} changed after the export"
    return ckpt, None


def _open_checkpoint(record: dict[str, Any], where: Path | str) -> Checkpoint:
    ckpt, problem = _checkpoint_state(record, where)
    if ckpt is None:
        raise ModelSourceError(f"{problem}; export the model again")
    return ckpt


def reference_problem(onnx_path: Path) -> str | None:
    """Why the graph at ``onnx_path`` can no longer read its checkpoint weights (the checkpoint moved or changed
    since the graph was written), or None (it reads none, or they are as they were)."""
    import onnx

    if not onnx_path.is_file():
        return None
    props = {p.key: p.value for p in onnx.load(str(onnx_path), load_external_data=False).metadata_props}
    return _checkpoint_state(json.loads(props[CHECKPOINT_KEY]), onnx_path)[1] if CHECKPOINT_KEY in props else None


def bind(model: ir.Model, where: Path | str = "the graph") -> int:
    """Turn the checkpoint inputs of ``model`` into initializers read lazily from the checkpoint; returns how many."""
    text = model.metadata_props.pop(CHECKPOINT_KEY, None)
    if text is None:
        return 0
    record = json.loads(text)
    ckpt = _open_checkpoint(record, where)
    graph = model.graph
    by_name = {v.name: v for v in graph.inputs}
    for name, w in record["weights"].items():
        value = by_name.get(name)
        if value is None:
            raise ModelSourceError(f"{where} lists checkpoint weight {name} but has no such input; produce it again")
        graph.inputs.remove(value)
        value.const_value = CheckpointTensor(ckpt, w["tensor"], w["transpose"], name, w.get("rows"))
        graph.register_initializer(value)
    return len(record["weights"])


def unbind(model: ir.Model) -> int:
    """Turn initializers read from a checkpoint back into graph inputs listed in the metadata; returns how many."""
    graph = model.graph
    refs = [v for v in graph.initializers.values() if isinstance(v.const_value, CheckpointTensor)]
    if not refs:
        return 0
    ckpt = refs[0].const_value.ckpt  # type: ignore[union-attr]
    weights = {}
    for v in refs:
        t = v.const_value
        assert isinstance(t, CheckpointTensor) and v.name is not None
        if t.ckpt is not ckpt:
            raise ValueError("one graph reads two checkpoints")
        weights[v.name] = (t.tensor, t.transpose, t.rows_used)
        graph.initializers.pop(v.name)
        v.const_value = None
        graph.inputs.append(v)
    model.metadata_props[CHECKPOINT_KEY] = reference_record(ckpt, weights)
    return len(refs)


def load_graph(path: Path, unreadable: type[TrtInferError] = ModelSourceError) -> ir.Model:
    """An ONNX file (external data beside it) with its checkpoint weights bound (:func:`bind`); ``unreadable`` is
    raised, in one line, when the file is not an ONNX model."""
    try:
        model = ir.load(str(path))
    except Exception as e:
        raise unreadable(f"{path} is not a readable ONNX model: {e}") from e
    bind(model, path)
    return model


def save_graph(model: ir.Model, path: Path, *, keep_references: bool = True) -> None:
    """Save ``model`` with its weights in ``<name>.data`` beside it, 64 KiB-aligned so ONNX Runtime maps them.

    With ``keep_references`` the checkpoint weights stay references (inputs + metadata); otherwise every weight is
    written, one tensor at a time.
    """
    if keep_references:
        unbind(model)
    ir.save(model, str(path), external_data=path.name + ".data", size_threshold_bytes=1024, alignment=ALIGN)


def release_weights(model: ir.Model) -> None:
    """Drop every initializer's tensor from ``model`` once it is written. A rewrite library may keep a reference to
    the last graph it matched (onnxscript's module-level rules do): the graph then outlives the stage, and with it
    every weight a pass converted (Llama-3.2-1B fp16: 2.6 GiB held through the compilation and the engine check)."""
    for value in model.graph.initializers.values():
        value.const_value = None
    model.graph.initializers.clear()


def graph_weight_bytes(path: Path) -> int:
    """Bytes of every weight of an ONNX file, written or read from its checkpoint (headers only)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in proto.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        total += int(ext.get("length", 0)) if "length" in ext else len(t.raw_data)
    refs = checkpoint_inputs(proto)
    for v in proto.graph.input:
        if v.name in refs:
            total += 4 * int(np.prod([d.dim_value for d in v.type.tensor_type.shape.dim], dtype=np.int64))
    return total


@contextlib.contextmanager
def materialized_file(path: Path, rewrite: Callable[[ir.Model], bool] | None = None) -> Iterator[Path]:
    """``path`` itself when it reads nothing from a checkpoint (and ``rewrite``, given the graph, changes nothing),
    else a whole copy, rewritten, in a temporary folder beside it (removed on exit)."""
    import onnx

    if rewrite is None and not checkpoint_inputs(onnx.load(str(path), load_external_data=False)):
        yield path
        return
    model = load_graph(path)
    refs = any(isinstance(v.const_value, CheckpointTensor) for v in model.graph.initializers.values())
    changed = rewrite is not None and rewrite(model)  # always run: it changes the copy written below too
    if not (refs or changed):
        yield path
        return
    stage_dir = path.parent
    with scratch_dir(stage_dir.parent, final_name(stage_dir)) as tmp:
        save_graph(model, tmp / path.name, keep_references=False)
        del model
        yield tmp / path.name


@contextlib.contextmanager
def materialized(stage: StageDir, rewrite: Callable[[ir.Model], bool] | None = None) -> Iterator[StageDir]:
    """``stage`` itself when its graph reads nothing from a checkpoint (and ``rewrite`` changes nothing), else the
    same stage in a temporary folder with a whole copy of the graph and links to its other files (removed on exit)."""
    with materialized_file(stage.onnx_path, rewrite) as path:
        if path == stage.onnx_path:
            yield stage
            return
        for name in stage.info.get("files", {}):
            if name not in (ONNX_NAME, DATA_NAME) and not (path.parent / name).exists():
                os.symlink((stage.path / name).resolve(), path.parent / name)
        if (stage.path / STAGE_FILE).is_file():
            os.symlink((stage.path / STAGE_FILE).resolve(), path.parent / STAGE_FILE)
        yield StageDir(path.parent, {**stage.info, CHECKPOINT_COUNT: 0})
