"""benchmarks/ is a package of runnable scripts over the installed project: no sys.path edits, one shared helper
(benchmarks.machine) for the machine, its kind, the commit and result names; each script answers --help as a module."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "machine"))


def test_no_sys_path_edits():
    edits = [p.name for p in (ROOT / "benchmarks").glob("*.py") if re.search(r"sys\.path\.(insert|append)", p.read_text())]
    assert edits == []


def test_result_names_say_what_where_when():
    from benchmarks.machine import cpu_kind, machine_info, result_path

    info = machine_info()
    path = result_path("loop_overhead", machine=info)
    assert path.parent.name == "results" and path.name.startswith(f"loop_overhead_{cpu_kind(info)}_20")
    assert path.suffix == ".json" and re.search(r"_\d{4}-\d{2}-\d{2}\.json$", path.name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_runs_as_a_module(script):
    p = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--help"], cwd=ROOT, capture_output=True,
                       text=True, check=False, timeout=120)
    assert p.returncode == 0 and "usage" in p.stdout.lower(), p.stderr[-500:]
