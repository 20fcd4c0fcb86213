"""Read a GGUF file: its metadata (scalars and strings) and its tensors by name, memory-mapped.

One reader serves the export (which writes a GGUF's dequantized tensors as a Hugging Face checkpoint, tensor by
tensor) and GGUF-exact quantization (which reads the same tensors' blocks by the names the export recorded).

``gguf.GGUFReader`` builds a numpy view per metadata item: 34 s for Gemma-3's 262,144-token vocabulary. Walking the
header and skipping array values by their lengths takes well under a second, and only the tensor data a caller asks
for is mapped.
"""
from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.errors import ModelSourceError

MAGIC = b"GGUF"
#: GGUF metadata value type id -> little-endian ``struct`` format (8 = string, 9 = array are walked apart)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's place in the file: ``shape`` in numpy order (``[N, K]`` for a Linear weight), ggml type name."""

    name: str
    qtype: str  # a ``gguf.GGMLQuantizationType`` name: "Q4_K", "F32", ...
    type_id: int
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes per row of the last dimension."""
        return self.nbytes // max(1, int(np.prod(self.shape[:-1], dtype=np.int64)))


class _Header:
    """A cursor over the start of a GGUF file, reading more as values need it."""

    def __init__(self, f: Any, path: Path, size: int) -> None:
        self.f, self.path, self.size, self.buf, self.pos = f, path, size, b"", 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:  # a damaged length or count: say so before reading (or allocating) it
            raise ModelSourceError(f"the GGUF header of {self.path} is damaged: a length at byte {self.pos} runs past "
                                   f"the end of the file ({self.size} bytes); download it again")
        while self.pos + n > len(self.buf):
            more = self.f.read(max(1 << 20, n))
            if not more:
                raise ModelSourceError(f"the GGUF header of {self.path} is damaged: the file ends inside it "
                                       f"(at byte {len(self.buf)}); download it again")
            self.buf += more

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        self.pos += n
        try:
            return self.buf[self.pos - n:self.pos].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelSourceError(f"the GGUF header of {self.path} is damaged near byte {self.pos}: {e}; "
                                   "download it again") from e

    def value(self, vtype: int) -> Any:
        """A metadata value: scalars and strings as Python values; arrays are skipped (None)."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALAR:
                size = struct.calcsize(_SCALAR[itype]) * count
                self.need(size)
                self.pos += size
            else:
                for _ in range(count):
                    self.value(itype)
            return None
        if vtype not in _SCALAR:
            raise ModelSourceError(f"the GGUF header of {self.path} is damaged near byte {self.pos}: a value of "
                                   f"unknown type {vtype}; download it again")
        v = self.scalar(_SCALAR[vtype])
        return bool(v) if vtype == 7 else v


class GGUFFile:
    """The metadata and tensors of the GGUF file at ``path``; tensor data is mapped only when read."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            h = _Header(f, self.path, size)
            h.need(24)
            if h.buf[:4] != MAGIC:
                raise ModelSourceError(f"{self.path} does not start with the GGUF magic bytes: not a GGUF file")
            h.pos = 4
            version = h.scalar("<I")
            if version not in (2, 3):
                raise ModelSourceError(f"{self.path} is GGUF version {version}; versions 2 and 3 are readable")
            n_tensors, n_kv = h.scalar("<Q"), h.scalar("<Q")
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = h.string()
                self.metadata[key] = h.value(h.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = h.string()
                dims = [h.scalar("<Q") for _ in range(h.scalar("<I"))]
                infos.append((name, dims, h.scalar("<I"), h.scalar("<Q")))
            alignment = int(self.metadata.get("general.alignment") or 32)
            start = (h.pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise ModelSourceError(f"tensor {name} of {self.path} has ggml type {type_id}, which the installed "
                                       "gguf package does not know; upgrade it (pip install -U gguf)") from None
            elems, block_bytes = GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))  # GGUF lists the fastest dimension first
            nbytes = int(np.prod(shape, dtype=np.int64)) // elems * block_bytes
            t = GGUFTensor(name, qtype.name, type_id, shape, start + offset, nbytes)
            if t.offset + t.nbytes > size:
                raise ModelSourceError(f"tensor {name} of {self.path} ends at byte {t.offset + t.nbytes} but the "
                                       f"file has {size}: it is truncated; download it again")
            self.tensors[name] = t

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as ``[rows, bytes per row]`` (a 1-D tensor is one row), memory-mapped read-only."""
        t = self.tensors[name]
        rows = t.nbytes // t.row_bytes
        return np.memmap(self.path, np.uint8, mode="r", offset=t.offset, shape=(rows, t.row_bytes))

    def check_dequantizable(self) -> None:
        """Raise ModelSourceError naming the first tensor whose ggml type the installed gguf package cannot
        dequantize (one block of each type is tried), before any work that would fail on it midway."""
        from importlib.metadata import version

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

        tried: set[int] = set()
        for t in self.tensors.values():
            if t.type_id in tried:
                continue
            tried.add(t.type_id)
            qtype = GGMLQuantizationType(t.type_id)
            try:
                quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
            except NotImplementedError:
                raise ModelSourceError(f"tensor {t.name} of {self.path} is ggml {t.qtype}, which gguf {version('gguf')} "
                                       "cannot dequantize; upgrade it (pip install -U gguf) or use another "
                                       "quantization of the model") from None

    def dequantize(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """float32 values of ``name`` (of its ``rows`` when given, for a 2-D tensor), as ggml computes them."""
        from gguf import GGMLQuantizationType, quants

        t = self.tensors[name]
        raw = self.raw(name)[rows]
        values = quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(t.type_id))
        shape = (raw.shape[0], *t.shape[1:]) if len(t.shape) > 1 else t.shape
        return np.asarray(values, np.float32).reshape(shape)

    def rows_in_order(self, name: str, order: np.ndarray | None, chunk_bytes: int = 1 << 20) -> Iterator[np.ndarray]:
        """float32 rows of the 2-D tensor ``name`` in the order ``order`` gives (row ``i`` is the tensor's row
        ``order[i]``; None: its own order), a chunk of about ``chunk_bytes`` at a time: the tensor is never whole.
        Small chunks are faster too: gguf-py's temporaries stay in the caches and off fresh pages (Q8_0 at 1 MB
        ~400M values/s, at 64 MB ~200M, the whole 128k x 2048 table at once 22M on a 2-vCPU EPYC)."""
        n, k = self.tensors[name].shape
        order = np.arange(n) if order is None else order
        step = max(1, chunk_bytes // (4 * k))
        for a in range(0, n, step):
            rows = order[a:a + step]
            lo, hi = int(rows.min()), int(rows.max()) + 1
            chunk = self.dequantize(name, slice(lo, hi))
            yield chunk if hi - lo == len(rows) and np.array_equal(rows, np.arange(lo, hi)) else chunk[rows - lo]


def llama_rows(n: int, heads: int) -> np.ndarray:
    """The rotary row order transformers gives Llama's q/k: Hugging Face row ``i`` is GGUF row ``order[i]``.

    llama.cpp's converter interleaves each head's two rotary halves; reading a GGUF, transformers undoes it
    (``w.reshape(heads, n/heads/2, 2, ...).swapaxes(2, 1)``); here the same on row indices.
    """
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def row_order(rows: dict[str, Any] | str, n: int) -> np.ndarray | None:
    """The row order a recorded ``rows`` entry names (see :func:`describe_rows`): None for the GGUF's own order."""
    if rows == "identity":
        return None
    if isinstance(rows, dict) and "heads" in rows:
        return llama_rows(n, int(rows["heads"]))
    raise ValueError(f"unknown row order {rows!r}")


def describe_rows(order: np.ndarray, candidate_heads: list[int]) -> dict[str, Any] | str | None:
    """``order`` (HF row ``i`` = GGUF row ``order[i]``) in the words :func:`row_order` reads, or None if none fits."""
    n = len(order)
    if np.array_equal(order, np.arange(n)):
        return "identity"
    for h in candidate_heads:
        if h and n % (2 * h) == 0 and np.array_equal(order, llama_rows(n, h)):
            return {"heads": int(h)}
    return None
