"""``trtinfer`` command line: one module per verb; flags map onto the stage configs and hold no logic."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from trtinfer.errors import TrtInferError

VERBS = ("export", "optimize", "build", "generate", "embed", "inspect", "bench", "cache")


def _parser() -> argparse.ArgumentParser:
    from trtinfer import __version__
    from trtinfer.cli import bench, build, cache, embed, export, generate, inspect, optimize

    p = argparse.ArgumentParser(prog="trtinfer", description="Export, build and run transformer engines.")
    p.add_argument("--version", action="version", version=f"trtinfer {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = p.add_subparsers(dest="verb", metavar="{" + ",".join(VERBS) + "}")
    for mod in (export, optimize, build, generate, embed, inspect, bench, cache):
        mod.add_parser(sub)
    return p



def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the process exit code (0 ok, 2 bad input, 1 failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    # global flags are accepted anywhere on the line, before or after the verb
    quiet = any(a in ("-q", "--quiet") for a in argv)
    argv = [a for a in argv if a not in ("--debug", "-q", "--quiet")]
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        args.debug, args.quiet = debug, quiet
    except SystemExit as e:  # argparse already printed usage + one error line
        return int(e.code or 0)
    level = logging.DEBUG if debug else (logging.WARNING if args.quiet else logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "transformers", "torch", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR if not debug else logging.DEBUG)
    if args.verb is None:
        parser.print_help(sys.stderr)
        return 2
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
        print(f"trtinfer {args.verb}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
