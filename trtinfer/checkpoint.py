"""Read a Hugging Face safetensors checkpoint tensor by tensor, memory-mapped: one shard file or hub-style shards.

The checkpoint's layout is read from its headers alone (``model.safetensors.index.json``'s tensor -> shard map,
then each shard's JSON header): nothing is loaded until a tensor is asked for, and then only that tensor's bytes
are mapped. Every tensor's byte range is checked against its shard's size when the checkpoint is opened, so a
missing shard or a truncated download is one clear error before any work starts.

The ``safetensors`` package would map a tensor just as well, but its numpy view has no bfloat16 (the dtype 1B-14B
checkpoints ship in) and a torch view would bring torch into every read; the format is a little-endian u64 header
length, a JSON header, then the raw tensors, so reading it with ``numpy.memmap`` is a few lines.

A folder converted from a large GGUF (``trtinfer.export.gguf_convert``) keeps most tensors in the GGUF it links to
(``model.gguf``); ``gguf.json`` marks those ``"view"``, and they are read here as float32, dequantized (and their
rows put in Hugging Face order) when asked for: one tensor at a time in memory, valid until another is read (a
reader that keeps values copies them).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.errors import ModelSourceError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
GGUF_ORIGINS = "gguf.json"  # a converted GGUF's record: each tensor's GGUF name, ggml type, row order, view or not
GGUF_LINK = "model.gguf"  # the GGUF a converted folder's viewed tensors are read from
#: safetensors dtype -> (numpy dtype of the stored words, bytes per element). BF16 is read as its uint16 words.
DTYPES: dict[str, tuple[type[np.generic], int]] = {"F32": (np.float32, 4), "F16": (np.float16, 2),
                                                   "BF16": (np.uint16, 2)}
#: the largest GGUF view decoded into the reused buffer (a layer's; a Qwen3-14B MLP matrix is 356 MB): a larger one
#: (the embedding table) takes its own memory, held until released, not for the checkpoint's life
SCRATCH_BYTES = 512 << 20
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: shard file, absolute byte offset, dtype and shape."""

    shard: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the shard."""
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPES[self.dtype][1]


def _read_header(shard: Path) -> dict[str, TensorInfo]:
    size = shard.stat().st_size
    with open(shard, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelSourceError(f"{shard} is truncated ({size} bytes): not a safetensors file; re-download it")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ModelSourceError(f"{shard} has a damaged or truncated header ({n} header bytes, file {size} "
                                   "bytes); re-download it")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ModelSourceError(f"{shard}'s header is not JSON ({e}); re-download it") from e
    if not isinstance(header, dict):
        raise ModelSourceError(f"{shard}'s header is not a safetensors header (a JSON object); re-download it")
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
            if not (isinstance(dtype, str) and all(d >= 0 for d in shape) and type(start) is int and type(end) is int
                    and 0 <= start <= end):
                raise ValueError("values out of range")
        except (TypeError, KeyError, ValueError) as e:
            raise ModelSourceError(f"tensor {name} in {shard.name} has a damaged header entry ({meta!r:.80}: "
                                   f"{type(e).__name__} {e}); re-download the shard") from e
        if dtype not in DTYPES:
            raise ModelSourceError(f"tensor {name} in {shard.name} is {dtype}; checkpoints in "
                                   f"{', '.join(DTYPES)} can be exported")
        info = TensorInfo(shard, 8 + n + int(start), dtype, shape)
        if end - start != info.nbytes:
            raise ModelSourceError(f"tensor {name} in {shard.name} declares {end - start} bytes for shape {shape} "
                                   f"{dtype} ({info.nbytes} expected): the shard is damaged; re-download it")
        if info.offset + info.nbytes > size:
            raise ModelSourceError(f"tensor {name} in {shard.name} is truncated: it ends at byte "
                                   f"{info.offset + info.nbytes} but the file has {size}; re-download the shard")
        out[name] = info
    return out


class Checkpoint:
    """The tensors of the safetensors checkpoint in ``folder``, read lazily through memory maps."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
                if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                    raise ValueError("its weight_map is not an object of tensor -> shard file names")
            except (ValueError, KeyError, TypeError) as e:
                raise ModelSourceError(f"{index} is not a safetensors index ({e}); re-download it") from e
            outside = [v for v in weight_map.values() if Path(v).name != v]
            if outside:
                raise ModelSourceError(f"{index} names a shard outside the checkpoint's folder ({outside[0]}); "
                                       "shards are files beside the index")
            shards = sorted(set(weight_map.values()))
        elif (self.folder / SINGLE_NAME).is_file():
            weight_map, shards = {}, [SINGLE_NAME]
        else:
            found = sorted(p.name for p in self.folder.glob("*.bin"))
            raise ModelSourceError(
                f"{self.folder} has no {SINGLE_NAME} nor {INDEX_NAME}"
                + (f" (it has {', '.join(found)}: convert it to safetensors with save_pretrained)" if found else "")
                + "; give a folder with safetensors weights")
        missing = [s for s in shards if not (self.folder / s).is_file()]
        if missing:
            raise ModelSourceError(f"{self.folder} misses {len(missing)} of the {len(shards)} shards its index "
                                   f"names ({', '.join(missing[:3])}); re-download the checkpoint")
        self.tensors: dict[str, TensorInfo] = {}
        for s in shards:
            self.tensors.update(_read_header(self.folder / s))
        absent = [k for k, s in weight_map.items() if k not in self.tensors]
        if absent:
            raise ModelSourceError(f"the index of {self.folder} maps {absent[0]} to {weight_map[absent[0]]}, which "
                                   "does not hold it; re-download the checkpoint")
        self._views: dict[str, tuple[str, np.ndarray | None]] = {}  # HF name -> (GGUF tensor, row order)
        self._memo: tuple[str, np.ndarray] | None = None
        self._scratch: np.ndarray | None = None  # the views' float32 buffer, grown to the largest tensor read
        if (self.folder / GGUF_ORIGINS).is_file():
            self._open_views(json.loads((self.folder / GGUF_ORIGINS).read_text())["tensors"])

    def _open_views(self, origins: dict[str, dict[str, Any]]) -> None:
        viewed = {name: o for name, o in origins.items() if o.get("view")}
        if not viewed:
            return
        from trtinfer.gguf_file import GGUFFile, row_order

        link = self.folder / GGUF_LINK
        if not link.is_file():
            raise ModelSourceError(f"{self.folder} reads its weights from the GGUF it was converted from, which is "
                                   "gone (moved or deleted); build from the GGUF again")
        self.gguf = GGUFFile(link)
        for name, o in viewed.items():
            t = self.gguf.tensors.get(o["gguf"])
            if t is None or list(t.shape) != list(o["shape"]):
                raise ModelSourceError(f"{link} has no tensor {o['gguf']} {o['shape']}: it is not the GGUF "
                                       f"{self.folder} was converted from; build from the GGUF again")
            self.tensors[name] = TensorInfo(link, t.offset, "F32", tuple(o["shape"]))
            self._views[name] = (t.name, row_order(o["rows"], t.shape[0]))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors as stored."""
        return sum(t.nbytes for t in self.tensors.values())

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored words, memory-mapped (read-only; BF16 as uint16); a GGUF view's float32 values."""
        if name in self._views:
            return self._decoded(name)
        info = self.tensors[name]
        return np.memmap(info.shard, dtype=DTYPES[info.dtype][0], mode="r", offset=info.offset, shape=info.shape)

    def _decoded(self, name: str) -> np.ndarray:
        """A GGUF view's float32 value, read-only, valid until another view is read (the last one is kept: callers
        read a tensor in pieces). Views up to :data:`SCRATCH_BYTES` are decoded into one buffer: memory a process
        has not touched yet is slow to fill (a fresh array per tensor made a 2-vCPU EPYC decode 48M values/s, not
        359M)."""
        memo = self._memo
        if memo is not None and memo[0] == name:
            return memo[1]
        self._memo = None
        tensor, order = self._views[name]
        shape = self.tensors[name].shape
        size = int(np.prod(shape, dtype=np.int64))
        if 4 * size > SCRATCH_BYTES:  # a vocabulary table: its own array, gone with release()
            out = np.empty(shape, np.float32)
        else:
            if self._scratch is None or self._scratch.size < size:
                self._scratch = None  # the smaller buffer goes before the larger one is taken
                self._scratch = np.empty(size, np.float32)
            out = self._scratch[:size].reshape(shape)
        rows = out.reshape(shape[0], -1)
        a = 0
        for chunk in self.gguf.rows_in_order(tensor, order):
            rows[a:a + len(chunk)] = chunk.reshape(len(chunk), -1)
            a += len(chunk)
        view = out.view()
        view.flags.writeable = False
        self._memo = (name, view)
        return view

    def viewed(self, name: str) -> bool:
        """Whether ``name`` is a GGUF view (:meth:`raw` gives a buffer the next view's read overwrites)."""
        return name in self._views

    def release(self) -> None:
        """Forget the kept GGUF view (a reader done with a tensor); its buffer stays for the next one."""
        self._memo = None


def to_float32(words: np.ndarray, dtype: str) -> np.ndarray:
    """Stored words (:meth:`Checkpoint.raw`, or a slice of them) as float32; BF16 widens exactly."""
    if dtype == "BF16":
        return (np.asarray(words, np.uint32) << 16).view(np.float32)
    return np.asarray(words, np.float32)
