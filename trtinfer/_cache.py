"""Content-hash keyed cache under ``~/.cache/trtinfer`` (override with ``TRTINFER_CACHE``).

Layout: ``<root>/<kind>/<key>/`` holds one entry's files plus ``.entry.json``, the record of each file (relative
path, size, sha256 and a stat stamp). An entry is reused only if its files still match that record: sizes always,
the hash of every file whose stamp changed (or of every file with ``verify="full"``). A damaged entry is removed
and built again.

Entries are written through :func:`trtinfer._outputs.atomic_dir` (crash-safe output directories).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtinfer._outputs import (
    TEMP_RE,
    apply_modes,
    atomic_dir,
    check_output_dir,
    current_umask,
    dir_size,
    discard,
    lock_dir,
    output_error,
    remove_if_stale,
    sweep_stale,
)
from trtinfer.errors import ConfigError, OutputError, OutputExistsError

log = logging.getLogger(__name__)

ENTRY_NAME = ".entry.json"
ENTRY_FORMAT = 1
VERIFY_MODES = ("stamp", "full")
_STAMP = ("mtime_ns", "ctime_ns", "inode")
_CHANGE_CACHE = "point TRTINFER_CACHE at another folder"


def cache_path() -> Path:
    """Where the cache is (``$TRTINFER_CACHE``, default ``~/.cache/trtinfer``), not created: :func:`cache_root` creates it."""
    given = os.environ.get("TRTINFER_CACHE")
    return Path(given) if given else Path.home() / ".cache" / "trtinfer"  # empty: the default, not the cwd


def cache_root() -> Path:
    """Return the cache root, creating it if needed."""
    root = cache_path()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:  # a file where the cache or a folder above it should be
        check_output_dir(root, overwrite=True, alternative=_CHANGE_CACHE)
        err = OutputError(f"cannot create the trtinfer cache {root}: it is a file; {_CHANGE_CACHE}")
        err.path = str(root)
        raise err from e
    except OSError as e:  # read-only, no permission, no space: one line naming the cache
        reason = e.strerror.lower() if e.strerror else str(e)
        err = OutputError(f"cannot create the trtinfer cache {root}: {reason}; {_CHANGE_CACHE}")
        err.path = str(root)
        raise err from e
    return root


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_dir(path: Path) -> str:
    """Hex sha256 over the names and bytes of a model folder's files (sorted, non-recursive, hidden files skipped).

    Every file counts (weights, config, tokenizer, ``chat_template.jinja``): each may end up in an export.
    """
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.is_file() and not p.name.startswith("."):
            h.update(p.name.encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()


def key_of(obj: Any) -> str:
    """Short stable hash of a JSON-serializable object (a cache key)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


# --- file records ---------------------------------------------------------------------------------------------------

def _stamp(st: os.stat_result) -> dict[str, int]:
    return {"mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _all_files(folder: Path) -> list[str]:
    names = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for f in files:
            p = Path(root) / f
            if p.is_file():
                names.append(p.relative_to(folder).as_posix())
    return sorted(n for n in names if n != ENTRY_NAME)


def record_files(folder: str | os.PathLike[str], names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Record each file of ``folder``: ``{relative path: {size, sha256, mtime_ns, ctime_ns, inode}}``.

    ``names`` (paths relative to ``folder``) limits the record; by default every file below ``folder`` except the
    cache's own ``.entry.json``. :func:`check_files` tells later whether the files still match.
    """
    folder = Path(folder)
    record: dict[str, dict[str, Any]] = {}
    for name in sorted(_all_files(folder) if names is None else names):
        path = folder / name
        st = path.stat()
        record[name] = {"size": st.st_size, "sha256": sha256_file(path), **_stamp(st)}
        if _stamp(path.stat()) != _stamp(st):  # written while we hashed it: no stamp, so the next check hashes it
            record[name]["mtime_ns"] = -1
    return record


def _check(folder: Path, record: dict[str, dict[str, Any]], mode: str) -> tuple[str | None, bool]:
    """``(first problem or None, whether a stamp in ``record`` was refreshed)``; mode is size, stamp or full."""
    stats: dict[str, os.stat_result] = {}
    for name, rec in sorted(record.items()):  # the cheap pass first: a missing or resized file needs no hashing
        try:
            st = (folder / name).stat()
        except (FileNotFoundError, NotADirectoryError):
            return f"{name}: missing", False
        except OSError as e:
            return f"{name}: cannot be read ({e.strerror})", False
        if not stat.S_ISREG(st.st_mode):
            return f"{name}: not a regular file", False
        if st.st_size != rec.get("size"):
            return f"{name}: size {st.st_size} != {rec.get('size')}", False
        stats[name] = st
    if mode == "size":
        return None, False
    refreshed = False
    for name, rec in sorted(record.items()):
        stamp = _stamp(stats[name])
        if mode == "stamp" and all(rec.get(k) == v for k, v in stamp.items()):
            continue
        try:
            digest = sha256_file(folder / name)
        except OSError as e:
            return f"{name}: cannot be read ({e.strerror})", refreshed
        if digest != rec.get("sha256"):
            return f"{name}: sha256 differs from the recorded one", refreshed
        if any(rec.get(k) != v for k, v in stamp.items()):
            rec.update(stamp)
            refreshed = True
    return None, refreshed


def check_files(folder: str | os.PathLike[str], record: dict[str, dict[str, Any]], full: bool = False) -> str | None:
    """Check ``folder``'s files against a :func:`record_files` record: None if they match, else the first problem.

    Every file must exist with its recorded size; a file whose stat stamp (mtime, ctime, inode) changed is hashed
    and compared, as is every file when ``full``. A file whose hash still matches gets its new stamp in ``record``
    (updated in place), so a caller that saves the record again skips hashing it next time.
    """
    return _check(Path(folder), record, "full" if full else "stamp")[0]


# --- the cache ------------------------------------------------------------------------------------------------------

def _read_entry(folder: Path) -> dict[str, Any] | None:
    """The parsed entry file, or None if there is none (an incomplete entry); ValueError/TypeError if unreadable."""
    try:
        text = (folder / ENTRY_NAME).read_text()
    except FileNotFoundError:
        return None
    entry = json.loads(text)
    if not (isinstance(entry, dict) and isinstance(entry.get("files"), dict)
            and all(isinstance(r, dict) for r in entry["files"].values())
            and type(entry.get("created", 0)) in (int, float)):
        raise TypeError("not an entry record")
    return entry


def _write_entry(folder: Path, entry: dict[str, Any]) -> None:
    tmp = folder / f"{ENTRY_NAME}.{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(json.dumps(entry, indent=1, sort_keys=True))
    os.replace(tmp, folder / ENTRY_NAME)


def _entry_problem(folder: Path, mode: str) -> str | None:
    """None if the entry at ``folder`` is whole (refreshing changed stamps), else what is wrong with it."""
    try:
        entry = _read_entry(folder)
    except (OSError, ValueError, TypeError) as e:
        return f"{ENTRY_NAME}: unreadable ({e})"
    if entry is None:
        return f"incomplete: no {ENTRY_NAME}"
    problem, refreshed = _check(folder, entry["files"], mode)
    if problem is None and refreshed:
        try:
            _write_entry(folder, entry)
        except OSError as e:  # a read-only cache still serves; it just hashes again next time
            log.debug("could not refresh the stamps of %s: %s", folder, e)
    return problem


def cached_dir(kind: str, key: str, make: Callable[[Path], object], *, verify: str = "stamp",
               stale: Callable[[Path], str | None] | None = None) -> Path:
    """Return ``cache_root()/kind/key``, calling ``make(tmp_dir)`` to fill it if absent, incomplete or damaged.

    A hit is checked against the entry's record first: every file must exist with its size, and a file whose
    stat stamp changed is hashed (``verify="full"``: every file is); then ``stale(entry)``, which says why a whole
    entry can no longer be used (what it refers to outside the cache changed), or None. A damaged or stale entry is
    logged as one warning, removed and made again. Leftovers of killed builds in the ``kind`` folder are removed on
    the way.
    """
    if verify not in VERIFY_MODES:
        raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    try:
        kind_dir = cache_root() / kind
    except OSError as e:
        err = output_error(e, cache_path() / kind / key, None, _CHANGE_CACHE)
        if err is None:
            raise
        raise err from e
    final = kind_dir / key
    sweep_stale(kind_dir)
    if final.is_dir():
        problem = _entry_problem(final, verify)
        if problem is None and stale is not None and (why := stale(final)) is not None:
            problem = f"stale: {why}"
        if problem is None:
            return final
        if problem.startswith("incomplete"):
            log.warning("cache entry %s/%s is incomplete (no %s); rebuilding it", kind, key, ENTRY_NAME)
        elif problem.startswith("stale: "):
            log.warning("cache entry %s/%s is stale (%s); rebuilding it", kind, key, problem[len("stale: "):])
        else:
            log.warning("cache entry %s/%s is damaged (%s); rebuilding it", kind, key, problem)
        discard(final)
    elif os.path.lexists(final):
        discard(final)
    try:
        # never replace an entry: another build may be reading it; if one appears meanwhile, it is used instead
        with atomic_dir(final, overwrite=False, alternative=_CHANGE_CACHE) as tmp:
            make(tmp)
            apply_modes(tmp, current_umask())  # before the record: chmod moves ctime, part of the stamp
            entry = {"format": ENTRY_FORMAT, "kind": kind, "key": key, "created": time.time(),
                     "files": record_files(tmp)}
            (tmp / ENTRY_NAME).write_text(json.dumps(entry, indent=1, sort_keys=True))
    except OutputExistsError:
        if not final.is_dir() or _entry_problem(final, verify) is not None:
            raise
        log.debug("cache entry %s/%s was completed by another process meanwhile; using it", kind, key)
    return final


# --- listing, cleaning, verifying (``trtinfer cache``) --------------------------------------------------------------

@dataclass(frozen=True)
class CacheEntry:
    """One directory in the cache: an entry (``ok``, ``incomplete``, ``damaged``) or a temp dir (``stale temp dir``,
    ``building`` while its creator lives)."""

    kind: str
    key: str
    path: Path
    bytes: int
    age_s: float
    status: str
    detail: str | None = None

    @property
    def is_temp(self) -> bool:
        """True for a temp or set-aside dir of a build, not an entry."""
        return self.status in ("stale temp dir", "building")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": self.kind, "key": self.key, "path": str(self.path), "bytes": self.bytes,
                "mb": round(self.bytes / 1e6, 3), "age_s": round(self.age_s, 1), "status": self.status,
                "detail": self.detail}


#: the folders of the cache root that trtinfer fills; anything else there is not ours to list or remove
CACHE_KINDS = ("models", "onnx", "optimized", "quantized", "compiled", "scores")


def _kind_dirs(kind: str | None) -> list[Path]:
    root = cache_root()
    if kind is not None and kind not in CACHE_KINDS:
        raise ConfigError(f"unknown cache kind '{kind}'; known: {', '.join(CACHE_KINDS)}")
    return [root / k for k in ((kind,) if kind else CACHE_KINDS) if (root / k).is_dir()]


def _describe(kind_dir: Path, p: Path, now: float) -> CacheEntry:
    size = dir_size(p)
    try:
        mtime = p.stat().st_mtime
    except OSError:
        mtime = now
    if TEMP_RE.match(p.name):
        fd = lock_dir(p)
        if fd is not None:
            os.close(fd)
        return CacheEntry(kind_dir.name, p.name, p, size, now - mtime, "stale temp dir" if fd is not None else "building")
    try:
        entry = _read_entry(p)
    except (OSError, ValueError, TypeError) as e:
        return CacheEntry(kind_dir.name, p.name, p, size, now - mtime, "damaged", f"{ENTRY_NAME}: unreadable ({e})")
    if entry is None:
        return CacheEntry(kind_dir.name, p.name, p, size, now - mtime, "incomplete", f"no {ENTRY_NAME}")
    age = now - float(entry.get("created", mtime))
    problem, _ = _check(p, entry["files"], "size")
    return CacheEntry(kind_dir.name, p.name, p, size, age, "ok" if problem is None else "damaged", problem)


def list_entries(kind: str | None = None) -> list[CacheEntry]:
    """Every directory in the cache (of ``kind`` if given), with its size, age and status.

    Only the cheap checks run here (entry file present, every file there with its size); :func:`verify_cache`
    hashes.
    """
    now = time.time()
    found = []
    for kind_dir in _kind_dirs(kind):
        for p in sorted(kind_dir.iterdir()):
            if p.is_dir() and not p.is_symlink():
                found.append(_describe(kind_dir, p, now))
    return found


def clean_cache(*, everything: bool = False, kind: str | None = None) -> list[CacheEntry]:
    """Remove stale temp dirs and incomplete or damaged entries (with ``everything``, every entry); returns them.

    ``kind`` limits the cleaning to one kind folder. Temp dirs of live builds are never removed.
    """
    removed = []
    for e in list_entries(kind):
        if e.status == "building":
            continue
        if e.status == "stale temp dir":
            if remove_if_stale(e.path) is not None:
                removed.append(e)
        elif everything or e.status in ("incomplete", "damaged"):
            discard(e.path)
            removed.append(e)
    return removed


def verify_cache(kind: str | None = None,
                 on_result: Callable[[CacheEntry, str | None], None] | None = None) -> list[tuple[CacheEntry, str | None]]:
    """Hash every file of every entry (of ``kind`` if given) against its record; remove the entries that fail.

    Returns ``(entry, problem or None)`` for each entry (temp dirs are left to :func:`clean_cache`), and calls
    ``on_result`` with each as soon as it is known.
    """
    results = []
    for e in list_entries(kind):
        if e.is_temp:
            continue
        problem = _entry_problem(e.path, "full")
        if problem is not None:
            log.debug("removing %s/%s: %s", e.kind, e.key, problem)
            discard(e.path)
        results.append((e, problem))
        if on_result is not None:
            on_result(e, problem)
    return results
