"""What the generate loop costs beside the model: host time per decode step outside the backend session's calls.

usage: python -m benchmarks.loop_overhead [--engine DIR ...] [--compare PATH] [--steps 64] [--rounds 3]

``generate`` is the scheduler's loop (:mod:`trtinfer.runtime.offline`: slots of one KV cache, a batched pass per
step, selection on the host). Its cost beside the model is measured directly, which timing whole steps on a noisy
2-core machine cannot do: the session's calls into the backend (``run_rows``/``run_bound``, and the older loop's
``prefill``/``decode``/``*_greedy``/``select_rows``) are wrapped with timers, and (wall time of ``generate`` - time
inside them) / steps is the loop's own time per step, at batch 1 and 8, greedy and top-p 0.9 sampling (which adds
the selection); ``wall_ms`` is the whole generate per step. ``--compare PATH`` runs the same measurement with another trtinfer checkout
(e.g. a ``git worktree`` of an older commit) in the same run, interleaved. Default engine: SmolLM2-135M int4 (the
fastest step, where overhead weighs most), built into the trtinfer cache. Prints a table, writes
benchmarks/results/loop_overhead.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.machine import machine_info, result_path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent

_WORKER = r'''
import json, sys, time, statistics
import trtinfer
eng = trtinfer.load(sys.argv[1])
steps, rounds = int(sys.argv[2]), int(sys.argv[3])
s = eng.session
inside, depth = [0.0], [0]
def wrap(name):
    f = getattr(s, name)
    def timed(*a, **k):
        depth[0] += 1
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                inside[0] += time.perf_counter() - t
    setattr(s, name, timed)
for n in ("prefill", "decode", "prefill_greedy", "decode_greedy", "select_rows", "run_bound", "run_rows"):
    if hasattr(s, n):  # the calls into the backend, whichever loop makes them (nested ones count once)
        wrap(n)
prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
out = {}
for bs in (1, 8):
    for name, kw in (("greedy", {"do_sample": False}), ("top_p=0.9", {"do_sample": True, "top_p": 0.9, "seed": 1})):
        eng.generate([prompt] * bs, max_new_tokens=4, ignore_eos=True, **kw)
        loop, step, wall = [], [], []
        for _ in range(rounds):
            inside[0] = 0.0
            t = time.perf_counter()
            res = eng.generate([prompt] * bs, max_new_tokens=steps, ignore_eos=True, **kw)
            total = time.perf_counter() - t
            loop.append((total - inside[0]) / steps * 1000)
            wall.append(total / steps * 1000)
            step.append(statistics.median(res[0].timings.decode_ms))
        out[f"{name} bs{bs}"] = {"loop_ms": min(loop), "step_ms": min(step), "wall_ms": min(wall)}
print(json.dumps(out))
'''


def default_engine() -> Path:
    from trtinfer.builder import BuildConfig, build

    out = Path(__file__).parent / ".engines" / "smollm2-135m-int4-cpu"
    if not (out / "manifest.json").is_file():
        build("smollm2-135m", out, BuildConfig(precision="int4"), progress=False, overwrite=True)
    return out


def measure(tree: Path, engine: Path, steps: int, rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, "-c", _WORKER, str(engine), str(steps), str(rounds)], capture_output=True,
                       text=True, env=env, check=False)
    if p.returncode:
        raise SystemExit(f"worker failed ({tree}): {p.stderr.strip().splitlines()[-1] if p.stderr else p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=None)
    ap.add_argument("--compare", type=Path, default=None, help="another trtinfer checkout to measure in the same run")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = args.engine or default_engine()
    trees = {"this": ROOT, **({"compare": args.compare.resolve()} if args.compare else {})}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for _ in range(2):  # interleaved: this, compare, this, compare
        for tag, tree in trees.items():
            runs[tag].append(measure(tree, engine, args.steps, args.rounds))
    keys = ("loop_ms", "step_ms", "wall_ms")
    summary = {tag: {case: {k: round(min(r[case][k] for r in rs), 3) for k in keys} for case in rs[0]}
               for tag, rs in runs.items()}
    print(f"{'case':<16}" + "".join(f"{t + ' ' + k.replace('_', ' '):>18}" for t in trees for k in keys))
    for case in summary["this"]:
        print(f"{case:<16}" + "".join(f"{summary[t][case][k]:>18.3f}" for t in trees for k in keys))
    RESULTS.mkdir(exist_ok=True)
    record = {"machine": machine_info(), "engine": str(engine), "trees": {k: str(v) for k, v in trees.items()},
              "steps": args.steps, "rounds": args.rounds, "summary": summary, "runs": runs}
    out = result_path("loop_overhead")
    out.write_text(json.dumps(record, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(summary["this"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(trees)
    for i, t in enumerate(trees):
        ax.bar([c + i * width for c in range(len(cases))], [summary[t][c]["loop_ms"] for c in cases], width, label=t)
    ax.set_xticks([c + width * (len(trees) - 1) / 2 for c in range(len(cases))], cases)
    ax.set_ylabel("host ms per step outside the model")
    ax.set_title("generate loop overhead per decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
