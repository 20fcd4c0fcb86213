"""The benchmarks' shared helper: what machine a run was on (CPU model, cores, the instruction-set flags that pick
kernels), its short kind, the commit measured, and result file names (what was measured, machine kind, date)."""
from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

KERNEL_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def machine_info() -> dict[str, Any]:
    """CPU model name, logical cores, and which of :data:`KERNEL_FLAGS` ``/proc/cpuinfo`` lists."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "cpu_flags": [f for f in KERNEL_FLAGS if f in flags]}


def cpu_kind(machine: dict[str, Any] | None = None) -> str:
    """Short name of the CPU for file names: vendor word + widest vector ISA (``amd-epyc-avx512``)."""
    machine = machine_info() if machine is None else machine
    words = re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*", "", machine["cpu"].lower()).split()[:2]
    isa = "avx512" if "avx512f" in machine["cpu_flags"] else "avx2" if "avx2" in machine["cpu_flags"] else "base"
    return "-".join(re.sub(r"[^a-z0-9]", "", w) for w in [*words, isa] if w)


def git_commit(checkout: Path = ROOT) -> str:
    """The commit measured (``git describe --always --dirty`` of ``checkout``, this one by default; ``unknown``
    outside a checkout)."""
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=checkout, capture_output=True, text=True,
                         check=False)
    return out.stdout.strip() or "unknown"


def result_path(what: str, suffix: str = ".json", machine: dict[str, Any] | None = None) -> Path:
    """``benchmarks/results/<what>_<machine kind>_<date><suffix>``: a result named by what it measured, where and
    when (a rerun on another machine or day writes beside it, never over it)."""
    return RESULTS / f"{what}_{cpu_kind(machine)}_{datetime.date.today().isoformat()}{suffix}"
