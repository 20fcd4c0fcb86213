"""Run the export's torch steps (GGUF conversion, trace + tokenizer, the eager reference's steps) in child
interpreters; ONNX Runtime's runs stay in the build's process.

torch and transformers take ~250 MiB of a process's memory once imported, and nothing frees it: a build that traced
its model in its own process carried them through compilation and the engine check, which map the engine's weights
on top (Gemma-3-270M fp32: 1.58 GiB peak, ~400 MiB of it anonymous at the check). In a child they leave with it.

:func:`run` calls ``fn(*args)`` in a new ``python`` (:data:`CHILD_MAIN`) when torch is not loaded in this process
yet (where it already is, a child would only add its start-up: the call runs here). ``fn`` and ``args`` travel
pickled (``fn`` a module-level function); the child's log records come back over a pipe and are handled by this
process's loggers (their levels are copied into the child, so nothing below them is sent), then the result or the
exception, raised here as it was raised there. ``TRTINFER_EXPORT_IN_PROCESS=1`` keeps every call in this process.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import IO, Any, TypeVar

from trtinfer.errors import ExportError

log = logging.getLogger(__name__)

T = TypeVar("T")
IN_PROCESS_ENV = "TRTINFER_EXPORT_IN_PROCESS"
_HEADER = struct.Struct(">I")
#: the child's program (not ``-m`` this module: the package would import it first, and runpy warns)
CHILD_MAIN = ("import sys; from trtinfer.export.isolated import child_main; "
              "sys.exit(child_main(int(sys.argv[1]), int(sys.argv[2])))")


def wanted() -> bool:
    """Whether :func:`run` would use a child: torch not loaded here, and not turned off by the environment."""
    return (os.name == "posix" and "torch" not in sys.modules  # pass_fds: POSIX only
            and os.environ.get(IN_PROCESS_ENV, "") in ("", "0"))


def _levels() -> dict[str, int]:
    """The levels this process's loggers are set to (root as ``""``), for the child to emit the same records."""
    levels = {"": logging.getLogger().level}
    for name, logger in logging.root.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET:
            levels[name] = logger.level
    return levels


def _send(out: IO[bytes], kind: str, obj: Any) -> None:
    data = pickle.dumps((kind, obj))
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def _messages(inp: IO[bytes]) -> Iterator[tuple[str, Any]]:
    while head := inp.read(_HEADER.size):
        if len(head) < _HEADER.size:
            return
        data = inp.read(_HEADER.unpack(head)[0])
        yield pickle.loads(data)


def run(fn: Callable[..., T], *args: Any, child: bool | None = None) -> T:
    """``fn(*args)``, in a child interpreter when ``child`` (None: when :func:`wanted`); see the module docstring."""
    if not (wanted() if child is None else child):
        return fn(*args)
    read_fd, write_fd = os.pipe()
    try:
        # the child's stdout goes to this process's stderr: a verb printing its result on stdout gets only its own
        proc = subprocess.Popen([sys.executable, "-c", CHILD_MAIN, str(write_fd), str(os.getpid())],
                                stdin=subprocess.PIPE, stdout=2, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    outcome: tuple[str, Any] | None = None
    try:
        assert proc.stdin is not None
        try:
            with proc.stdin:
                proc.stdin.write(pickle.dumps((fn, args, _levels())))
        except BrokenPipeError:  # the child died before reading its task: said below
            pass
        with os.fdopen(read_fd, "rb") as inp:
            for kind, obj in _messages(inp):
                if kind == "log":
                    logging.getLogger(obj.name).handle(obj)
                else:
                    outcome = (kind, obj)
        code = proc.wait()
    except BaseException:  # interrupted here: the child goes too
        proc.kill()
        proc.wait()
        raise
    if outcome is None:
        raise ExportError(f"the export's child process ended (exit code {code}) before it answered; "
                          f"{'killed by the system: out of memory?' if code < 0 else 'see the lines above'}")
    kind, obj = outcome
    if kind == "error":
        raise obj
    return obj  # type: ignore[no-any-return]


class _PipeHandler(logging.Handler):
    """Sends each record, its message formatted and its traceback as text, to the parent."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None
            _send(self.out, "log", record)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _die_with(parent: int) -> None:
    """Linux: have the kernel kill this process when its parent dies (a build stopped with SIGTERM or SIGKILL left
    its export child tracing, and holding its memory, to the end); exit now if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os._exit(1)


def child_main(fd: int, parent: int) -> int:
    """The child's side of :func:`run`: read the task, answer over ``fd``; killed with ``parent``."""
    _die_with(parent)
    fn, args, levels = pickle.loads(sys.stdin.buffer.read())
    with os.fdopen(fd, "wb") as out:
        root = logging.getLogger()
        root.handlers[:] = [_PipeHandler(out)]
        for name, level in levels.items():
            logging.getLogger(name or None).setLevel(level)
        try:
            result: tuple[str, Any] = ("ok", fn(*args))
        except BaseException as e:
            log.debug("in the export's child process", exc_info=True)
            result = ("error", e)
        try:
            _send(out, *result)
        except Exception as e:  # noqa: BLE001 - an exception that cannot be pickled: its text
            _send(out, "error", ExportError(f"{type(result[1]).__name__}: {result[1]} ({e})"))
    return 0

