"""``trtinfer`` command line: one module per verb; flags map onto the stage configs and hold no logic."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError

from trtinfer.errors import TrtInferError

#: The verbs, in help order; each is the module ``trtinfer.cli.<verb>`` with ``add_parser(sub)`` (registering a verb is
#: adding its name here).
VERBS = ("export", "optimize", "quantize", "build", "generate", "serve", "embed", "eval", "inspect", "bench", "cache",
         "triton")

#: The optional parts of trtinfer: extra -> (what it is, the modules it brings). ``pip install trtinfer`` alone is the
#: runtime (onnxruntime, numpy, tokenizers, jinja2, tqdm): enough for generate, embed, inspect.
EXTRAS = {
    "export": ("the export stack", ("torch", "transformers", "onnx", "onnxscript", "onnx_ir", "gguf", "ml_dtypes")),
    "serve": ("the HTTP server", ("fastapi", "uvicorn", "prometheus_client")),
    "ray": ("Ray Serve", ("ray",)),
    "triton": ("tritonclient", ("tritonclient",)),
    "tensorrt": ("TensorRT", ("tensorrt",)),
}
#: Verbs that cannot run at all without an extra; checked before they start.
VERB_EXTRAS = {"export": "export", "optimize": "export", "quantize": "export", "build": "export", "serve": "serve",
               "triton": "triton"}


def _extra_of(module: str | None) -> str | None:
    """The extra that brings ``module`` (a dotted name or a distribution name), if any."""
    root = (module or "").split(".")[0].replace("-", "_")
    return next((extra for extra, (_, mods) in EXTRAS.items() if root in mods), None)


def _missing(extra: str) -> str | None:
    """The first module of ``extra`` that is not installed (looked up, not imported), or None."""
    from importlib.util import find_spec

    for module in EXTRAS[extra][1]:
        try:
            if find_spec(module) is None:
                return module
        except (ImportError, ValueError):  # a finder that refuses it, or a module without a spec
            return module
    return None


def _absent_name(e: BaseException) -> str | None:
    """The module or distribution ``e`` says is not installed, if it says so."""
    if isinstance(e, ModuleNotFoundError):
        return e.name
    if isinstance(e, PackageNotFoundError) and e.args:
        return str(e.args[0])
    return None


def _needs_line(verb: str, extra: str) -> str:
    return f"trtinfer {verb} needs {EXTRAS[extra][0]}: pip install 'trtinfer[{extra}]'"


def _stub(sub: argparse._SubParsersAction, verb: str, extra: str) -> None:  # type: ignore[type-arg]
    """A verb whose module cannot be imported here: it accepts any arguments and says what to install."""
    p = sub.add_parser(verb, help=f"(needs pip install 'trtinfer[{extra}]')", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: _needs_exit(verb, extra))


def _needs_exit(verb: str, extra: str) -> int:
    print(_needs_line(verb, extra), file=sys.stderr)
    return 2


def parser() -> argparse.ArgumentParser:
    """The `trtinfer` command line: every verb and flag (verbs whose extra is missing accept anything and say so)."""
    from importlib import import_module

    from trtinfer.version import __version__

    p = argparse.ArgumentParser(prog="trtinfer", description="Export, build and run transformer engines.")
    p.add_argument("--version", action="version", version=f"trtinfer {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show other libraries' log lines and progress bars (transformers, onnxruntime)")
    sub = p.add_subparsers(dest="verb", metavar="{" + ",".join(VERBS) + "}")
    for verb in VERBS:
        try:  # a verb module imports only light modules at the top; the heavy stack when it runs
            import_module(f"trtinfer.cli.{verb}").add_parser(sub)
        except ModuleNotFoundError as e:
            extra = _extra_of(e.name)
            if extra is None:
                raise
            _stub(sub, verb, extra)
    return p


class _PersonFormatter(logging.Formatter):
    """trtinfer's INFO lines as plain sentences; warnings and errors prefixed with their level. A record logged with
    its exception (a server's failed request, a failed scheduler step: a bug, not bad input) keeps its traceback at
    ERROR, and at any level with ``debug`` (the server told clients "the server log has the details", and it had
    none)."""

    def __init__(self, debug: bool = False) -> None:
        super().__init__()
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING:
            msg = f"{record.levelname.lower()}: {msg}"
        elif not record.name.startswith("trtinfer"):
            msg = f"{record.name}: {msg}"
        if (record.exc_info or record.exc_text) and (self.debug or record.levelno >= logging.ERROR):
            msg += "\n" + (record.exc_text or self.formatException(record.exc_info))  # type: ignore[arg-type]
        return msg


class _TqdmHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes log lines above the progress display instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def _setup_logging(debug: bool, quiet: bool, verbose: bool) -> None:
    """trtinfer's own INFO lines (WARNING with -q); other libraries' lines and progress bars only with -v."""
    if not verbose:
        # transformers and huggingface_hub read this when imported: no third-party progress bars
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    handler = _TqdmHandler()
    handler.setFormatter(_PersonFormatter(debug))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _TqdmHandler)]:  # main() may run twice in a process
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else (logging.INFO if verbose else logging.WARNING))
    own = logging.getLogger("trtinfer")
    own.setLevel(logging.DEBUG if debug else (logging.WARNING if quiet else logging.INFO))
    if not verbose:
        for noisy in ("transformers", "torch", "onnxscript", "onnx_ir", "onnxruntime", "httpx", "urllib3"):
            logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the process exit code (0 ok, 2 bad input, 1 failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    # global flags are accepted anywhere on the line, before or after the verb
    quiet = any(a in ("-q", "--quiet") for a in argv)
    verbose = debug or any(a in ("-v", "--verbose") for a in argv)
    argv = [a for a in argv if a not in ("--debug", "-q", "--quiet", "-v", "--verbose")]
    cli = parser()
    try:
        args = cli.parse_args(argv)
        args.debug, args.quiet, args.verbose = debug, quiet, verbose
    except SystemExit as e:  # argparse already printed usage + one error line
        return int(e.code or 0)
    _setup_logging(debug, quiet, verbose)
    if args.verb is None:
        cli.print_help(sys.stderr)
        return 2
    extra = VERB_EXTRAS.get(args.verb)
    if extra is not None and _missing(extra) is not None:
        return _needs_exit(args.verb, extra)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("trtinfer: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except TrtInferError as e:
        if debug:
            raise
        print(f"trtinfer {args.verb}: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # an unexpected failure still gets one line unless --debug
        if debug:
            raise
        extra = _extra_of(_absent_name(e))
        if extra is not None:  # an optional part this run reached is not installed
            return _needs_exit(args.verb, extra)
        print(f"trtinfer {args.verb}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
