"""guidellm's load on ``trtinfer serve`` from two checkouts (an earlier commit and this one), interleaved in one sitting.

usage: python -m benchmarks.guidellm_ab --run NAME=CHECKOUT:ENGINE[@SERVE_ARGS] [--run ...] [--rounds 3] [--levels 8]
                                        [--requests-per-level 32] [--baseline NAME_PREFIX] [--out PATH]

Each ``--run`` names one server: ``CHECKOUT`` is a trtinfer checkout (``git worktree add /tmp/old REV`` for an earlier
commit; ``.`` for this one) whose runtime serves ``ENGINE`` (an engine that checkout built), with ``SERVE_ARGS``
(comma-separated ``trtinfer serve`` flags, e.g. ``@--prefill-chunk=512``) where given. A round runs every
``--run`` once, in the order given, each a whole :mod:`benchmarks.guidellm_serve` run (a fresh server, one warm-up
request, guidellm at ``--levels``); this checkout's script drives them all, the server is that checkout's: the
script runs with the checkout as its working directory, and ``python -m trtinfer.cli serve`` starts there, so it
imports the checkout's ``trtinfer``. The summary pairs runs by the words after the side: ``old-fp32`` and
``new-fp32`` compare as fp32, the ``--baseline`` side (default: the first run's word before ``-``) against the others.

Writes ``PATH.json`` (machine, each run's commit, engine and guidellm_serve record, a summary per precision: mean
output tok/s per side, the ratio to the baseline, TTFT p50 and the ratio, ITL p99/p50) and ``PATH.png`` (default
PATH: ``benchmarks/results/guidellm_ab_<cpu kind>_<date>``); prints the table. Each run's own record and guidellm's
log go to ``PATH_runs/`` (its chart and guidellm's raw report are deleted: they would double the results' size).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import ROOT, git_commit, machine_info, result_path


def parse_run(text: str) -> tuple[str, Path, Path, list[str]]:
    """``NAME=CHECKOUT:ENGINE[@SERVE_ARGS]`` -> (name, checkout, engine, serve args); name is ``SIDE-PRECISION``."""
    name, _, rest = text.partition("=")
    rest, _, serve_args = rest.partition("@")
    checkout, _, engine = rest.partition(":")
    if not (name and "-" in name and checkout and engine):
        raise argparse.ArgumentTypeError(f"--run {text!r}: expected SIDE-PRECISION=CHECKOUT:ENGINE")
    checkout_path, engine_path = Path(checkout).expanduser().resolve(), Path(engine).expanduser().resolve()
    if not (checkout_path / "trtinfer").is_dir():
        raise argparse.ArgumentTypeError(f"--run {name}: {checkout_path} is not a trtinfer checkout")
    if not (engine_path / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"--run {name}: {engine_path} has no manifest.json")
    return name, checkout_path, engine_path, [a for a in serve_args.split(",") if a]


def one_run(name: str, checkout: Path, engine: Path, serve_args: list[str], args: argparse.Namespace,
            out: Path) -> dict[str, Any]:
    """One guidellm_serve run against ``checkout``'s server; its record."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "guidellm_serve.py"), "--engine", str(engine),
           "--levels", *map(str, args.levels), "--requests-per-level", str(args.requests_per_level), "--out", str(out),
           *(f"--serve-arg={a}" for a in serve_args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's benchmarks; the server imports cwd's trtinfer
    print(f"--- {name}: {' '.join(cmd)} (in {checkout})", flush=True)
    subprocess.run(cmd, cwd=checkout, env=env, check=True)
    for bulky in (out.with_name(out.name + ".png"), out.with_name(out.name + "_raw.json.gz")):
        bulky.unlink(missing_ok=True)  # the run's record and log stay; its chart and raw report are in neither summary
    return json.loads(out.with_name(out.name + ".json").read_text())


def summarize(runs: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    """Per precision: mean output tok/s and TTFT p50 per side, the ratios to ``baseline``, ITL p99/p50 per run."""
    summary: dict[str, Any] = {}
    for precision in sorted({r["precision"] for r in runs}):
        sides: dict[str, dict[str, list[float]]] = {}
        for r in (r for r in runs if r["precision"] == precision):
            level = r["level"]
            s = sides.setdefault(r["side"], {"tok_s": [], "ttft_p50_ms": [], "itl_p99_over_p50": []})
            s["tok_s"].append(level["output_tokens_per_s"])
            s["ttft_p50_ms"].append(level["ttft_p50_ms"])
            s["itl_p99_over_p50"].append(round(level["itl_p99_ms"] / level["itl_p50_ms"], 2))
        base = sides.get(baseline)
        for side, s in sides.items():
            s["mean_tok_s"] = round(statistics.mean(s["tok_s"]), 1)
            s["mean_ttft_p50_ms"] = round(statistics.mean(s["ttft_p50_ms"]), 1)
            if base is not None and side != baseline:
                s["throughput_ratio"] = round(s["mean_tok_s"] / statistics.mean(base["tok_s"]), 3)
                s["ttft_p50_ratio"] = round(s["mean_ttft_p50_ms"] / statistics.mean(base["ttft_p50_ms"]), 3)
        summary[precision] = sides
    return summary


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'precision':<10} {'side':<8} {'out tok/s (runs)':<28} {'mean':>7} {'ratio':>6} {'TTFT p50 ms':>12} "
          f"{'ratio':>6} {'ITL p99/p50':>16}")
    for precision, sides in summary.items():
        for side, s in sides.items():
            runs = ", ".join(f"{v:.1f}" for v in s["tok_s"])
            print(f"{precision:<10} {side:<8} {runs:<28} {s['mean_tok_s']:>7.1f} {s.get('throughput_ratio', 1.0):>6.3f} "
                  f"{s['mean_ttft_p50_ms']:>12.0f} {s.get('ttft_p50_ratio', 1.0):>6.3f} "
                  f"{', '.join(map(str, s['itl_p99_over_p50'])):>16}")


def runs_chart(bars: list[tuple[str, str, list[float], list[float]]], title: str, path: Path,
               tick_size: float | None = None) -> None:
    """Output tok/s and TTFT p50 side by side: per bar (label, colour, each run's tok/s, each run's TTFT p50 ms), the
    mean as the bar and every run as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what, values in ((axes[0], "output tok/s (each run)", [b[2] for b in bars]),
                             (axes[1], "TTFT p50 ms", [b[3] for b in bars])):
        for i, vs in enumerate(values):
            ax.bar(i, statistics.mean(vs), color=bars[i][1], alpha=0.6)
            ax.scatter([i] * len(vs), vs, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=tick_size)
        ax.set_title(what)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart(summary: dict[str, Any], title: str, path: Path) -> None:
    """:func:`runs_chart` of :func:`summarize`'s sides, precision by precision."""
    sides = [(precision, side, s) for precision, by_side in summary.items() for side, s in by_side.items()]
    runs_chart([(f"{precision}\n{side}", "tab:blue" if i % 2 else "tab:gray", s["tok_s"], s["ttft_p50_ms"])
                for i, (precision, side, s) in enumerate(sides)], title, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=parse_run, action="append", required=True, metavar="SIDE-PRECISION=CHECKOUT:ENGINE")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levels", type=int, nargs="+", default=[8])
    ap.add_argument("--requests-per-level", type=int, default=32)
    ap.add_argument("--baseline", default=None, help="the side others are compared with (default: the first run's)")
    ap.add_argument("--what", default="", help="a sentence on what is compared, kept in the JSON")
    ap.add_argument("--out", type=Path, default=None, help="output path without suffix")
    args = ap.parse_args()
    if len(args.levels) != 1:
        ap.error("--levels: one level per A/B (the summary compares one concurrency)")
    machine = machine_info()
    out = args.out or result_path("guidellm_ab", "", machine)
    out = out.resolve()  # the runs start in other checkouts
    work = out.with_name(out.name + "_runs")
    work.mkdir(parents=True, exist_ok=True)
    baseline = args.baseline or args.run[0][0].split("-", 1)[0]
    commits = {name: git_commit(checkout) for name, checkout, _, _ in args.run}
    runs = []
    for rnd in range(1, args.rounds + 1):
        for name, checkout, engine, serve_args in args.run:
            record = one_run(name, checkout, engine, serve_args, args, work / f"{name}-{rnd}")
            side, precision = name.split("-", 1)
            runs.append({"side": side, "precision": precision, "round": rnd, "code": commits[name],
                         "engine": str(engine), "serve_args": serve_args, "level": record["levels"][0],
                         "checks": record["checks"],
                         "load_average": record["load_average"]})
    summary = summarize(runs, baseline)
    print_table(summary)
    record = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "what": args.what, "baseline": baseline,
              "levels": args.levels, "requests_per_level": args.requests_per_level, "rounds": args.rounds,
              "command": [sys.executable, *sys.argv], "runs": runs, "summary": summary}
    json_path, png_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".png")
    json_path.write_text(json.dumps(record, indent=1))
    chart(summary, f"guidellm on trtinfer serve, {args.levels[0]} streams: {', '.join(commits[n] + ' ' + n for n, *_ in args.run)}",
          png_path)
    print(f"wrote {json_path}, {png_path}")


if __name__ == "__main__":
    main()
