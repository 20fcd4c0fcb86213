"""No-change rebuild time: `trtinfer build MODEL -o DIR --force` when every stage is already in the cache.

usage: python -m benchmarks.rebuild [--models gemma-3-270m smollm2-135m] [--runs 3]
The first build fills the cache (export, optimize; the engine itself is not cached: every build compiles it into
``-o`` and checks it again); the timed runs are the whole CLI command as a user types it (process start, imports,
cache verification, compilation and engine check), best and median of --runs. Prints a table, writes benchmarks/results/rebuild.json and benchmarks/results/rebuild.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import machine_info, result_path

RESULTS = Path(__file__).parent / "results"


def timed_build(model: str, out: Path) -> tuple[float, dict]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "trtinfer", "-q", "build", model, "-o", str(out), "--force"],
                       capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"build of {model} failed: {p.stderr.strip()}")
    return wall, json.loads((out / "manifest.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gemma-3-270m", "smollm2-135m"])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            first, m = timed_build(model, Path(tmp) / model)
            first_reused = [n for n, r in m["stages"].items() if r.get("cached")]
            walls, stages = [], {}
            for _ in range(args.runs):
                wall, m = timed_build(model, Path(tmp) / model)
                walls.append(wall)
                stages = m["stages"]
            size = sum(f.stat().st_size for f in (Path(tmp) / model).iterdir())
            rows.append({"model": model, "first_build_s": round(first, 2), "first_build_reused": first_reused, "rebuild_best_s": round(min(walls), 2),
                         "rebuild_median_s": round(statistics.median(walls), 2), "runs": walls,
                         "engine_mib": round(size / 2**20), "stages_of_last_rebuild": stages,
                         "stages_reused": [n for n, r in stages.items() if r.get("cached")]})
            print(f"{model}: first build {first:.1f} s, rebuild best {min(walls):.1f} s "
                  f"(median {statistics.median(walls):.1f} s, {size / 2**20:.0f} MiB engine)", flush=True)
    print("\n| model | first build of this run s (stages it reused) | no-change rebuild s (best / median) | engine MiB "
          "| rebuild reused |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['first_build_s']:.1f} ({', '.join(r['first_build_reused']) or 'none'}) | "
              f"{r['rebuild_best_s']:.1f} / {r['rebuild_median_s']:.1f} | {r['engine_mib']} | "
              f"{', '.join(r['stages_reused']) or 'none'} |")
    RESULTS.mkdir(exist_ok=True)
    out = result_path("rebuild")
    out.write_text(json.dumps({"machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    names = [r["model"] for r in rows]
    ax.barh(names, [r["rebuild_best_s"] for r in rows], color="tab:green", label="no-change rebuild (best)")
    ax.axvline(10, color="tab:red", linestyle="--", label="10 s target")
    ax.set_xlabel("seconds (whole `trtinfer build` command)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
