"""What loading an engine and generating with it costs in memory: the process's peak RSS against the engine's weight
bytes, for this checkout's runtime and (optionally) another checkout's, interleaved in one sitting.

usage: python -m benchmarks.load_peak ENGINE [ENGINE ...] [--baseline DIR] [--rounds 2] [--prompt-len 128]
       [--new-tokens 16]

Each measurement is ``python -m trtinfer.bench engine ENGINE 1 PROMPT_LEN NEW_TOKENS`` in a fresh process (load,
warm-up, five one-token calls, three generations; its VmHWM at the end), run from this checkout and, with
``--baseline DIR`` (a checkout of an earlier commit, e.g. ``git worktree add /tmp/old REV``), from that one, baseline
first in every round. Target (issue 20): peak <= 1.25x the engine's weight bytes. Writes
``benchmarks/results/load_peak_<cpu>_<date>.{json,png}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.machine import git_commit, machine_info, result_path
from trtinfer.runtime.memory import weight_bytes

ROOT = Path(__file__).resolve().parent.parent


def measure(engine: Path, source: Path, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """One ``trtinfer.bench engine`` run with the runtime of checkout ``source``: its result dict."""
    cmd = [sys.executable, "-m", "trtinfer.bench", "engine", str(engine), "1", str(prompt_len), str(new_tokens)]
    env = {**os.environ, "PYTHONPATH": str(source)}  # that checkout's trtinfer, not the installed one
    done = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} (in {source}) failed: {(done.stderr or done.stdout).strip()[-400:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def chart(report: dict[str, Any], path: Path) -> None:
    """Peak RSS / weight bytes per engine and code (bars, every run a dot), the 1.25x target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    codes = list(report["codes"])
    width = 0.8 / len(codes)
    for i, code in enumerate(codes):
        rows = [r for r in report["rows"] if r["code"] == code]
        xs = [j + i * width for j in range(len(rows))]
        bars = ax.bar(xs, [r["ratio_median"] for r in rows], width, label=f"{code} ({report['codes'][code]})")
        ax.bar_label(bars, fmt="%.2fx", fontsize=7)
        for x, r in zip(xs, rows):
            ax.scatter([x] * len(r["ratios"]), r["ratios"], s=8, color="black", zorder=3)
    names = [r["engine"] for r in report["rows"] if r["code"] == codes[0]]
    ax.set_xticks([j + width * (len(codes) - 1) / 2 for j in range(len(names))], names, fontsize=7)
    ax.axhline(1.25, color="red", linestyle="--", linewidth=1, label="target 1.25x")
    ax.set_ylabel("peak RSS / engine weight bytes")
    ax.set_title(f"load + generate peak ({report['machine']['cpu']}, {report['machine']['cores']} cores)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--baseline", type=Path, help="a checkout of an earlier commit, measured the same way")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    sources = {"now": ROOT} if args.baseline is None else {"baseline": args.baseline.resolve(), "now": ROOT}
    codes = {name: git_commit(src) for name, src in sources.items()}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for engine in args.engines:
            for name, src in sources.items():
                res = measure(engine.resolve(), src, args.prompt_len, args.new_tokens)
                runs.setdefault((str(engine), name), []).append(res)
                print(f"{engine.name:<28} {name:<9} peak {res['peak_rss_mib']:8.0f} MiB  "
                      f"decode {res['decode_tok_s']:6.2f} tok/s", flush=True)
    rows = []
    for (engine, name), results in runs.items():
        size = weight_bytes(Path(engine) / "model.onnx")
        peaks = [r["peak_rss_mib"] for r in results]
        ratios = [p * 2**20 / size for p in peaks]
        rows.append({"engine": Path(engine).name, "path": engine, "code": name, "weight_bytes": size,
                     "peak_rss_mib": peaks, "ratios": [round(x, 3) for x in ratios],
                     "ratio_median": round(statistics.median(ratios), 3),
                     "decode_tok_s": [round(r["decode_tok_s"], 3) for r in results],
                     "ttft_ms": [round(r["ttft_ms"], 1) for r in results]})
    print("\n| engine | code | weight MiB | peak MiB (runs) | peak / weights | decode tok/s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['code']} ({codes[r['code']]}) | {r['weight_bytes'] / 2**20:.0f} | "
              f"{', '.join(f'{p:.0f}' for p in r['peak_rss_mib'])} | {r['ratio_median']:.2f}x | "
              f"{', '.join(f'{d:.2f}' for d in r['decode_tok_s'])} |")
    report = {"machine": machine_info(), "codes": codes, "settings": vars(args) | {
        "engines": [str(e) for e in args.engines], "baseline": str(args.baseline) if args.baseline else None},
        "target_ratio": 1.25, "rows": rows}
    out = result_path("load_peak")
    out.write_text(json.dumps(report, indent=2))
    chart(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
