"""MkDocs hook: pages generated at build time, so they cannot drift from the code and the results.

- ``reference/cli.md``: every ``trtinfer`` verb's ``--help``, from the argparse parsers themselves.
- ``reference/errors.md``: the exception hierarchy of ``trtinfer/errors.py``, from the classes and their docstrings.
- ``benchmarks/results/*.md``: one page per ``benchmarks/results/*.json`` (its machine, the date and commit of the
  file's last change, its tables), with the chart of the same name; ``benchmarks/results/index.md`` lists them.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    files.append(File.generated(config, "reference/errors.md", content=errors_page()))
    pages = []
    for path in sorted(RESULTS.glob("*.json")):
        files.append(File.generated(config, f"benchmarks/results/{path.stem}.md", content=result_page(path)))
        png = path.with_suffix(".png")
        if png.is_file():
            files.append(File.generated(config, f"benchmarks/results/{png.name}", content=png.read_bytes()))
        pages.append(path)
    files.append(File.generated(config, "benchmarks/results/index.md", content=results_index(pages)))
    return files


# --- the CLI reference --------------------------------------------------------------------------------------------
def cli_page() -> str:
    from trtinfer.cli import parser

    top = parser()
    intro = ("Generated from the `trtinfer` argparse parsers at docs build time: every verb and flag as "
             "`trtinfer VERB --help` prints it.")
    out = ["# CLI reference", "", intro, "", "```text", _help(top), "```", ""]
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))  # the stdlib's subparsers action
    for verb, p in sub.choices.items():
        out += [f"## trtinfer {verb}", "", "```text", _help(p), "```", ""]
    return "\n".join(out)


def _help(p: argparse.ArgumentParser) -> str:
    import os

    os.environ["COLUMNS"] = "110"  # argparse wraps at the terminal width: one width for every build
    return p.format_help().rstrip()


# --- the errors reference -----------------------------------------------------------------------------------------
ERRORS_INTRO = """# Errors

Every error trtinfer raises on purpose derives from `TrtInferError` (`trtinfer/errors.py`; this page is generated
from it). The command line prints one line, `trtinfer VERB: error: <what is wrong and what to do>`, and exits
non-zero (`--debug` shows the traceback); the server answers OpenAI-shaped errors (`{"error": {"message", "type",
"param", "code"}}`): `InputError`/`ConfigError` 400 naming the parameter at fault, an unknown model 404,
`QueueFullError` 429 with `Retry-After`, a closed scheduler 503, anything else 500 (logged), and keeps serving.

| error | derives from | raised when |
|---|---|---|
"""


def errors_page() -> str:
    import inspect

    from trtinfer import errors

    rows = []
    for name, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, errors.TrtInferError) and cls.__module__ == errors.__name__:
            bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
            doc = " ".join((cls.__doc__ or "").split()).replace("|", "\\|")
            rows.append((cls.__mro__[::-1].index(cls), name, f"| `{name}` | {bases} | {doc} |"))
    return ERRORS_INTRO + "\n".join(r[2] for r in sorted(rows)) + "\n"


# --- benchmark result pages ---------------------------------------------------------------------------------------
def _git(path: Path) -> str:
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs %h", "--", str(path)], cwd=ROOT, capture_output=True,
                             text=True, check=False, timeout=30).stdout.strip()
    except OSError:
        out = ""
    return out or "not committed"


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v, ensure_ascii=False)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return lines


def _sections(data: Any, name: str, depth: int = 2) -> list[str]:
    """A JSON value as markdown: scalars as a key/value table, lists of objects as tables, nested objects as sections."""
    out: list[str] = []
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return [f"{'#' * depth} {name}", "", *_table(data), ""]
    if not isinstance(data, dict):
        return [f"{'#' * depth} {name}", "", f"`{_cell(data)}`", ""]
    scalars = {k: v for k, v in data.items() if not isinstance(v, (dict, list)) or (isinstance(v, list) and not
                                                                                   any(isinstance(x, dict) for x in v))}
    if scalars:
        out += [f"{'#' * depth} {name}", "", "| field | value |", "|---|---|"]
        out += [f"| {k} | {_cell(v)} |" for k, v in scalars.items()]
        out.append("")
    for k, v in data.items():
        if k in scalars or k == "machine":
            continue
        if depth >= 4:
            out += [f"**{k}**: `{_cell(v)}`", ""]
            continue
        out += _sections(v, k, depth + 1)
    return out


def result_page(path: Path) -> str:
    data = json.loads(path.read_text())
    machine = data.get("machine") if isinstance(data, dict) else None
    origin = (f"`benchmarks/results/{path.name}`, last changed {_git(path)} (date, commit). Generated from the file "
              "at docs build time.")
    lines = [f"# {path.stem}", "", origin, ""]
    if isinstance(machine, dict):
        flags = machine.get("cpu_flags")
        shown = {k: v for k, v in machine.items() if k != "cpu_flags"}
        lines += ["**Machine**: " + ", ".join(f"{k} {_cell(v)}" for k, v in shown.items())
                  + (f"; CPU flags: {' '.join(flags)}" if flags else ""), ""]
    else:
        lines += ["**Machine**: not recorded in this file (the benchmark pages that cite it say where it ran).", ""]
    if path.with_suffix(".png").is_file():
        lines += [f"![{path.stem}]({path.stem}.png)", ""]
    lines += _sections(data, "Data")
    return "\n".join(lines)


def results_index(paths: list[Path]) -> str:
    intro = ("Every `benchmarks/results/*.json`, one page each, generated at docs build time (the narrative pages "
             "quote them).")
    lines = ["# Result files", "", intro, "", "| file | last changed | chart |", "|---|---|---|"]
    for p in paths:
        chart = "yes" if p.with_suffix(".png").is_file() else ""
        lines.append(f"| [{p.stem}]({p.stem}.md) | {_git(p)} | {chart} |")
    return "\n".join(lines) + "\n"
