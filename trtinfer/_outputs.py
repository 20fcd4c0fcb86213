r"""Crash-safe output directories: every output directory (a cache entry, an ``-o`` folder) is written through
:func:`atomic_dir`: a temp dir ``.NAME.tmp-PID-RANDOM`` beside the final path, locked with ``flock`` for as long as its
creator lives, renamed into place on success. The lock is what tells a live build from a stale leftover: the kernel
drops it when the process dies, SIGKILL included, so the next :func:`atomic_dir` (or the cache's ``cached_dir``) in
that folder removes the leftover. Failures to write become one-line :class:`~trtinfer.errors.OutputError`\ s.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trtinfer.errors import OutputError, OutputExistsError

log = logging.getLogger(__name__)

#: a temp (``.tmp-``) or set-aside (``.old-``) directory of atomic_dir, whatever the final name
TEMP_RE = re.compile(r"^\.(.+?)\.(?:tmp|old)-[^/]+$")  # group 1: the final name
_NO_SPACE = "No space left on device"
_MAPPED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_CHANGE_OUTPUT = "choose another -o"


# --- modes, locks, temp dirs ----------------------------------------------------------------------------------------

def current_umask() -> int:
    """The process umask, read from ``/proc/self/status`` (no set-and-restore window) where the kernel offers it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def entry_modes(umask: int) -> tuple[int, int]:
    """The (folder, file) modes a plain mkdir/open gives under ``umask``: 0o777/0o666 less it."""
    return 0o777 & ~umask, 0o666 & ~umask


def apply_modes(top: Path, umask: int) -> None:
    """Give ``top`` and everything below it the modes a plain mkdir/open would have: 0o777/0o666 less the umask.

    Files that were owner-executable stay executable for whoever the umask allows. Modes already right are left
    alone: chmod changes ctime, which the cache's stat stamps compare.
    """
    dir_mode, file_mode = entry_modes(umask)

    def fix(path: str, st: os.stat_result, want: int) -> None:
        if stat.S_IMODE(st.st_mode) != want:
            os.chmod(path, want)

    for root, dirs, files in os.walk(top, topdown=False):
        for name in files + dirs:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                fix(path, st, dir_mode)
            elif stat.S_ISREG(st.st_mode):
                fix(path, st, dir_mode if st.st_mode & stat.S_IXUSR else file_mode)
    fix(str(top), os.lstat(top), dir_mode)


def link_into(src: Path, dst: Path) -> bool:
    """Hard-link ``dst`` to ``src`` (a user's file a cache entry names without a second copy); False where not done.

    Only a file that already has the mode :func:`apply_modes` gives an entry's files is linked: the entry's modes
    are set through its names, and a chmod through the link would change the user's file (a 0600 model made
    world-readable, a read-only one writable). Not linked either: another file system, a file the user may not link.
    """
    # a hub snapshot's file is a relative symlink: the link names its blob (os.link would link the symlink itself,
    # dangling once it lies in the cache)
    real = os.path.realpath(src)
    try:
        if stat.S_IMODE(os.stat(real).st_mode) != entry_modes(current_umask())[1]:
            return False
        os.link(real, dst)
    except OSError:
        return False
    return True


def lock_dir(path: Path, wait: bool = False) -> int | None:
    """An fd on directory ``path`` holding its exclusive flock, or None if another process holds it (or it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _locked_temp_dir(parent: Path, name: str) -> tuple[Path, int]:
    """Create ``parent/.NAME.tmp-PID-RANDOM`` and lock it; returns the path and the fd holding the lock."""
    for _ in range(100):
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=parent))
        # Another process may lock it between our mkdir and flock: `cache info` probing (it lets go at once) or a
        # sweeper taking it for stale (it removes it, which the check below sees); so wait for the lock, then look.
        fd = lock_dir(tmp, wait=True)
        if fd is None:
            continue
        try:
            same = os.fstat(fd).st_nlink > 0 and os.stat(tmp).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if same:
            return tmp, fd
        os.close(fd)  # a sweeper removed it before we locked it
    raise OSError(errno.EAGAIN, "could not create a temp dir that stays", str(parent))


def final_name(path: Path) -> str:
    """The name directory ``path`` has when done: NAME for :func:`atomic_dir`'s ``.NAME.tmp-PID-RANDOM``."""
    m = TEMP_RE.match(path.name)
    return m.group(1) if m else path.name


@contextmanager
def scratch_dir(parent: str | os.PathLike[str], name: str) -> Iterator[Path]:
    """A directory for work files, ``parent/.NAME.tmp-PID-RANDOM``, removed on exit. Named and locked as
    :func:`atomic_dir`'s temp dirs are: no sweep touches it while this process lives (``trtinfer cache clean``,
    another build), and once it dies (SIGKILL included) the next sweep of ``parent`` (the next build of NAME, the
    cache's) removes it. Whole-model copies, calibration pieces and the reduced-depth check's build live in these."""
    tmp, fd = _locked_temp_dir(Path(parent), name)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def remove_if_stale(path: Path) -> int | None:
    """Remove temp dir ``path`` if no live process holds its lock; the bytes freed, or None if it was left."""
    fd = lock_dir(path)
    if fd is None:
        return None
    try:
        size = dir_size(path)
        shutil.rmtree(path)
        return size
    except OSError as e:
        log.debug("could not remove stale %s: %s", path, e)
        return None
    finally:
        os.close(fd)


def _is_temp_name(name: str, final_name: str | None) -> bool:
    if final_name is None:
        return bool(TEMP_RE.match(name))
    return name.startswith((f".{final_name}.tmp-", f".{final_name}.old-"))


def sweep_stale(folder: str | os.PathLike[str], final_name: str | None = None) -> list[tuple[Path, int]]:
    """Remove leftover temp dirs of :func:`atomic_dir` in ``folder`` whose creator is gone; returns (path, bytes).

    With ``final_name``, only ``.FINAL_NAME.tmp-*`` and ``.FINAL_NAME.old-*``; else every ``.*.tmp-*`` /
    ``.*.old-*`` directory. A directory whose lock a live process holds is never touched.
    """
    folder = Path(folder)
    removed: list[tuple[Path, int]] = []
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return removed
    for p in children:
        if _is_temp_name(p.name, final_name) and p.is_dir() and not p.is_symlink():
            size = remove_if_stale(p)
            if size is not None:
                log.debug("removed stale %s (%.1f MB)", p, size / 1e6)
                removed.append((p, size))
    return removed


def _set_aside(path: Path) -> tuple[Path, int | None]:
    """Rename ``path`` to ``.NAME.old-PID-RANDOM`` and lock it; returns the new path and the lock's fd."""
    # Locked before the rename so no sweeper takes it for stale while we remove it. If the lock is busy (its
    # creator has not closed it yet, or forked a child that kept it) go on without: a sweeper removing a
    # set-aside dir at the same time does no harm.
    fd = lock_dir(path) if path.is_dir() and not path.is_symlink() else None
    old = path.with_name(f".{path.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(path, old)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return old, fd


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def discard(path: Path) -> None:
    """Remove ``path`` (set aside first, so a crash midway leaves a sweepable ``.old-`` dir, not half an entry)."""
    try:
        old, fd = _set_aside(path)
    except FileNotFoundError:  # another process removed it first
        return
    try:
        _remove(old)
    finally:
        if fd is not None:
            os.close(fd)


# --- output errors --------------------------------------------------------------------------------------------------

def _inside(name: Any, bases: list[Path]) -> bool:
    try:
        p = os.fsdecode(name)
    except TypeError:
        return False
    forms = {Path(os.path.abspath(p)), Path(os.path.realpath(p))}
    return any(f == b or f.is_relative_to(b) for f in forms for b in bases)


def _is_ancestor(name: Any, paths: list[Path]) -> bool:
    try:
        p = Path(os.path.abspath(os.fsdecode(name)))
    except TypeError:
        return False
    return any(q.is_relative_to(p) for q in paths)


def _forms(path: Path) -> list[Path]:
    return [Path(os.path.abspath(path)), Path(os.path.realpath(path))]


def _root_code(e: BaseException | None) -> int | None:
    """The errno an output error stands for, following ``__cause__`` through wrapping errors."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError) and e.errno in _MAPPED_ERRNOS:
            return e.errno
        if isinstance(e, Exception) and _NO_SPACE in str(e):
            return errno.ENOSPC
        e, seen = e.__cause__, seen + 1
    return None


def output_error(e: BaseException, final: Path, tmp: Path | None, alternative: str) -> OutputError | None:
    """``e`` as an :class:`OutputError` naming ``final`` if it is an unwritable or full output location, else None.

    An OSError counts only if the file it names (if any) is in the temp dir, in ``final``'s folder, or (while
    that folder is being created) one of its ancestors; an OutputError from a nested atomic_dir only if it names a
    path inside our temp dir.
    """
    parent_forms = _forms(final.parent)
    if isinstance(e, OutputError):
        if tmp is None or e.path is None or not _inside(e.path, _forms(tmp)):
            return None
        code = _root_code(e.__cause__)
    elif isinstance(e, OSError):
        names = [n for n in (e.filename, e.filename2) if n is not None]
        bases = parent_forms + (_forms(tmp) if tmp is not None else [])
        for n in names:  # while the folder is being made (no tmp yet) the failing path may be an ancestor
            if not (_inside(n, bases) or (tmp is None and _is_ancestor(n, parent_forms))):
                return None
        code = _root_code(e)
    elif isinstance(e, Exception):
        code = _root_code(e)
    else:
        return None
    if code is None:
        return None
    where = final.parent
    if code == errno.ENOSPC:
        msg = f"no space left on the device holding {where} (writing {final}); free space or {alternative}"
    elif code == errno.EDQUOT:
        msg = f"disk quota exceeded on the device holding {where} (writing {final}); free space or {alternative}"
    elif code == errno.EROFS:
        msg = f"cannot write {final}: read-only file system; {alternative}"
    elif code == errno.EFBIG:
        msg = f"cannot write {final}: a file is larger than its file system allows; {alternative}"
    else:
        msg = f"cannot write {final}: permission denied; {alternative} or fix the folder's permissions"
    err = OutputError(msg)
    err.path = str(final)
    return err


# --- atomic output directories --------------------------------------------------------------------------------------

def _exists_error(final: Path) -> OutputExistsError:
    err = OutputExistsError(f"{final} already exists; choose another -o or pass --force to replace it")
    err.path = str(final)
    return err


def _commit(tmp: Path, final: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``final``, setting an existing ``final`` aside first when ``overwrite``."""
    for _ in range(10):  # another process may commit or remove the same final between our look and our rename
        if not os.path.lexists(final):
            try:
                tmp.rename(final)
                return
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                continue
        if not overwrite:
            raise _exists_error(final)
        try:
            old, fd = _set_aside(final)
        except FileNotFoundError:
            continue
        try:
            try:
                tmp.rename(final)
            except BaseException:
                os.rename(old, final)  # put the previous content back: readers keep seeing a whole directory
                raise
            _remove(old)
            return
        finally:
            if fd is not None:
                os.close(fd)
    raise FileExistsError(errno.EEXIST, "kept being replaced by another process", str(final))


def check_output_dir(final: str | os.PathLike[str], *, overwrite: bool = False,
                     alternative: str = _CHANGE_OUTPUT, inputs: Sequence[str | os.PathLike[str]] = (),
                     copies_inputs: bool = False) -> None:
    """Raise :class:`OutputError` now if ``final`` cannot become a new directory: it exists (unless ``overwrite``),
    a path above it is a file, or it is one of ``inputs`` (the paths the work reads) or holds one (replacing it would
    replace the input); with ``copies_inputs`` (the work copies an input folder into ``final``) also inside one. Call
    it before long work whose result goes to ``final``."""
    final = Path(final)
    for given in inputs:
        here, there = final.resolve(), Path(given).resolve()
        if here == there or here in there.parents or (copies_inputs and there in here.parents):
            how = "is" if here == there else "is inside" if there in here.parents else "holds"
            err = OutputError(f"the output {final} {how} the input {given}; write it outside the input")
            err.path = str(final)
            raise err
    if not overwrite and os.path.lexists(final):
        raise _exists_error(final)
    for above in final.parents:  # nearest first: the first one there must be a folder
        if os.path.isdir(above):
            return
        if os.path.lexists(above):
            what = "a file" if os.path.isfile(above) else "not a folder"
            err = OutputError(f"cannot create {final}: {above} is {what}; {alternative}")
            err.path = str(final)
            raise err


@contextmanager
def atomic_dir(final: str | os.PathLike[str], *, overwrite: bool = False, alternative: str = _CHANGE_OUTPUT,
               inputs: Sequence[str | os.PathLike[str]] = (), copies_inputs: bool = False) -> Iterator[Path]:
    """Yield a locked temp folder beside ``final``; on success rename it to ``final``, on failure remove it.

    Readers never see a half-written ``final``: it either holds the previous content or the new one. Before
    starting, leftovers of killed runs for the same ``final`` (``.NAME.tmp-*``, ``.NAME.old-*`` no live process
    holds) are removed. The result gets the modes the umask asks for (not mkdtemp's 0o700). An unwritable, read-only
    or full location raises :class:`OutputError` naming ``final`` and suggesting ``alternative``; so does a ``final``
    that overlaps one of ``inputs`` (:func:`check_output_dir`).
    """
    final = Path(final)
    check_output_dir(final, overwrite=overwrite, alternative=alternative, inputs=inputs,  # before the work
                     copies_inputs=copies_inputs)
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(final.parent, final.name)
        tmp, fd = _locked_temp_dir(final.parent, final.name)
    except OSError as e:
        err = output_error(e, final, None, alternative)
        if err is None and isinstance(e, FileNotFoundError):  # a folder no file can be made in (-o /proc/x)
            err = OutputError(f"cannot create {final}: {e.strerror.lower() if e.strerror else e}; {alternative}")
            err.path = str(final)
        if err is None:
            raise
        raise err from e
    try:
        try:
            yield tmp
            apply_modes(tmp, current_umask())
            _commit(tmp, final, overwrite)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = output_error(e, final, tmp, alternative)
            if err is None:
                raise
            raise err from e
    finally:
        os.close(fd)
