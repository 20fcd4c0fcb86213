"""Content-hash keyed cache under ``~/.cache/trtinfer`` (override with ``TRTINFER_CACHE``)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """Return the cache root, creating it if needed."""
    root = Path(os.environ.get("TRTINFER_CACHE", Path.home() / ".cache" / "trtinfer"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_dir(path: Path, suffixes: tuple[str, ...] = (".json", ".safetensors", ".bin", ".model", ".txt")) -> str:
    """Hex sha256 over the names and bytes of a model folder's files (sorted, non-recursive)."""
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.is_file() and p.suffix in suffixes:
            h.update(p.name.encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()


def key_of(obj: Any) -> str:
    """Short stable hash of a JSON-serializable object (a cache key)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


@contextmanager
def atomic_dir(final: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside ``final``; on success rename it to ``final``, on failure remove it.

    Readers never see a half-written ``final``: it either holds the previous content or the new one.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            if not overwrite:
                raise FileExistsError(str(final))
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cached_dir(kind: str, key: str, make: Callable[[Path], None]) -> Path:
    """Return ``cache_root()/kind/key``, calling ``make(tmp_dir)`` to fill it once if absent."""
    final = cache_root() / kind / key
    if (final / ".complete").exists():
        return final
    if final.exists():  # a stale, incomplete entry from an older crash
        shutil.rmtree(final, ignore_errors=True)
    with atomic_dir(final, overwrite=True) as tmp:
        make(tmp)
        (tmp / ".complete").write_text("ok\n")
    return final
