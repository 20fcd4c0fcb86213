"""What machine a benchmark ran on: CPU model, core count and the instruction-set flags that pick kernels."""
from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

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
