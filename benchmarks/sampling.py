"""Per-step next-token selection time: the sampling rewrite against the implementation before it.

usage: python -m benchmarks.sampling [--engine DIR] [--vocab 49152] [--steps 200] [--rounds 3]
Random logits of SmolLM2's vocabulary size, batch 1 and 8, for greedy, top_p=0.9, top_k=50, top_p+top_k+min_p and
temperature alone; "before" is ``trtinfer/runtime/sampling.py`` as of commit 1279c45, kept verbatim below (names
prefixed ``old_``; it has no min_p, so its top_p+top_k+min_p entry runs top_p+top_k). Two kinds of logits: "lm",
shaped like SmolLM2-135M's (a broad background, std ~3, and a few tokens 5-15 above it: top-p 0.9 nuclei of ~5
tokens, a few past 1,000, as SmolLM2's own), and "flat" (std 1: nuclei of ~30,000 tokens, the worst case, where
top-p sorts the whole row). Each entry is the median over ``--steps`` calls of ``select_next`` on a pool of
different logits (min beside it). With ``--engine DIR`` the engine's own decode step is timed through
``trtinfer.load(DIR).generate`` at batch 1 and 8 (the smallest of ``--rounds`` medians of the per-token decode
times): greedy, and top_p=0.9 sampling with the new and the old selection, for the target "a sampling step adds
<= 10% to a greedy step". Prints a table, writes benchmarks/results/sampling.json and benchmarks/results/sampling.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import machine_info, result_path
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.sampling import select_next

RESULTS = Path(__file__).parent / "results"
CONFIGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "top_p=0.9": {"do_sample": True, "top_p": 0.9},
    "top_k=50": {"do_sample": True, "top_k": 50},
    "top_p=0.9+top_k=50+min_p=0.05": {"do_sample": True, "top_p": 0.9, "top_k": 50, "min_p": 0.05},
    "temperature=0.7": {"do_sample": True, "temperature": 0.7},
}


# --- before: trtinfer/runtime/sampling.py at 1279c45, verbatim but for the old_ prefix -----------------------------
def old_apply_repetition_penalty(logits: np.ndarray, seen: Sequence[np.ndarray], penalty: float) -> None:
    """In place, per row: logits of already-seen tokens are divided (if > 0) or multiplied (if < 0) by ``penalty``."""
    if penalty == 1.0:
        return
    for r, ids in enumerate(seen):
        if len(ids) == 0:
            continue
        uniq = np.unique(ids)
        vals = logits[r, uniq]
        logits[r, uniq] = np.where(vals < 0, vals * penalty, vals / penalty)


def old_top_k_top_p_filter(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Set logits outside the top-k and outside the smallest top-p nucleus to -inf (the first token always stays)."""
    out = logits.copy()
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(out, vocab - top_k, axis=-1)[:, vocab - top_k][:, None]
        out[out < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-out, axis=-1, kind="stable")
        sorted_logits = np.take_along_axis(out, order, axis=-1)
        probs = old_softmax(sorted_logits)
        cum = np.cumsum(probs, axis=-1)
        remove_sorted = (cum - probs) > top_p  # tokens whose predecessors already cover top_p
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        out[remove] = -np.inf
    return out


def old_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for -inf entries."""
    z = x - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def old_select_next(logits: np.ndarray, cfg: GenerationConfig, seen: Sequence[np.ndarray], n_generated: int,
                eos_ids: Sequence[int], rngs: Sequence[np.random.Generator], hook: Any = None) -> np.ndarray:
    """Pick one token per row of ``logits [B, V]``; ``rngs`` holds one generator per row (sampling only).

    (``hook``, the user's logits processor of today's signature, is never set by this benchmark.)"""
    logits = logits.astype(np.float32, copy=True)
    old_apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
    if n_generated < cfg.min_new_tokens and eos_ids:
        logits[:, list(eos_ids)] = -np.inf
    if not cfg.do_sample:
        return logits.argmax(axis=-1).astype(np.int64)  # type: ignore[no-any-return]
    logits = old_top_k_top_p_filter(logits / cfg.temperature, cfg.top_k, cfg.top_p)
    probs = old_softmax(logits.astype(np.float64))
    out = np.empty(len(probs), dtype=np.int64)
    for r, p in enumerate(probs):
        out[r] = rngs[r].choice(len(p), p=p)
    return out


# --- the benchmark ------------------------------------------------------------------------------------------------
def make_logits(kind: str, batch: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Random logits: "lm" (background std 3, 16 tokens 5-15 above it) or "flat" (std 1)."""
    if kind == "flat":
        return (rng.standard_normal((batch, vocab))).astype(np.float32)
    x = rng.standard_normal((batch, vocab)) * 3.0
    for r in range(batch):
        x[r, rng.choice(vocab, 16, replace=False)] += rng.uniform(5, 15, 16)
    return x.astype(np.float32)


def nucleus_sizes(pool: Sequence[np.ndarray], top_p: float = 0.9) -> list[int]:
    """How many tokens top-p keeps in each row of the pool (for the table: what the logits look like)."""
    sizes = []
    for x in pool:
        for row in x.astype(np.float64):
            p = np.sort(np.exp(row - row.max()))[::-1]
            p /= p.sum()
            sizes.append(int(((np.cumsum(p) - p) < top_p).sum()))
    return sizes


def time_selection(fn: Callable[..., np.ndarray], pool: Sequence[np.ndarray], cfg: GenerationConfig,
                   steps: int) -> tuple[float, float]:
    """Median and min milliseconds of one ``fn(logits, cfg, seen, ...)`` call over ``steps`` calls."""
    batch = len(pool[0])
    rngs = [np.random.default_rng(i) for i in range(batch)]
    seen = [np.arange(64, dtype=np.int64) for _ in range(batch)]
    fn(pool[0], cfg, seen, 0, [], rngs)
    times = []
    for i in range(steps):
        x = pool[i % len(pool)]
        t0 = time.perf_counter()
        fn(x, cfg, seen, 0, [], rngs)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


def engine_steps(engine_dir: str, batches: Sequence[int], new_tokens: int, rounds: int) -> list[dict[str, Any]]:
    """The engine's decode step (ms) at each batch: greedy, top_p=0.9 sampling with this selection, and with the
    old one (patched into the generator for the run). The three run in turn ``rounds`` times; each entry is the
    smallest of its rounds' medians (over steps and rows), so a burst of other load on the machine hits one round,
    not one column."""
    import trtinfer
    from trtinfer.runtime import generator

    prompts = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):",
               "My favourite food is", "The weather today", "In 1969, the first", "Water boils at",
               "A good way to learn"]
    runs = [("greedy", {}, select_next),
            ("top_p=0.9", {"do_sample": True, "top_p": 0.9, "seed": 0}, select_next),
            ("top_p=0.9 before", {"do_sample": True, "top_p": 0.9, "seed": 0}, old_select_next)]
    rows = []
    with trtinfer.load(engine_dir) as engine:
        for batch in batches:
            medians: dict[str, list[float]] = {name: [] for name, _, _ in runs}
            for _ in range(rounds):
                for name, kw, fn in runs:
                    generator.select_next = fn  # type: ignore[assignment]
                    try:
                        engine.generate(prompts[:batch], max_new_tokens=2, ignore_eos=True, **kw)  # warm-up
                        res = engine.generate(prompts[:batch], max_new_tokens=new_tokens, ignore_eos=True, **kw)
                    finally:
                        generator.select_next = select_next
                    medians[name].append(statistics.median([t for r in res for t in r.timings.decode_ms]))
            row: dict[str, Any] = {"batch": batch}
            row.update({f"{name} step_ms": round(min(v), 3) for name, v in medians.items()})
            row["rounds_ms"] = {name: [round(t, 3) for t in v] for name, v in medians.items()}
            rows.append(row)
            print(f"engine batch {batch}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("_ms")),
                  flush=True)
    return rows


def chart(rows: list[dict[str, Any]], engine: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["logits"] for r in rows}, reverse=True)
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(kinds), len(batches), figsize=(5.5 * len(batches), 3.6 * len(kinds)), squeeze=False)
    for i, kind in enumerate(kinds):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            sel = [r for r in rows if r["logits"] == kind and r["batch"] == batch]
            y = np.arange(len(sel))
            ax.barh(y + 0.2, [r["before_ms"] for r in sel], 0.4, color="tab:gray", label="before")
            ax.barh(y - 0.2, [r["after_ms"] for r in sel], 0.4, color="tab:green", label="after")
            ax.set_yticks(y, [r["config"] for r in sel], fontsize=7)
            ax.invert_yaxis()
            ax.set_xscale("log")
            ax.set_xlabel("ms per selection step (median)")
            ax.set_title(f"{kind} logits, batch {batch}", fontsize=9)
            step = next((e["greedy step_ms"] for e in engine if e["batch"] == batch), None)
            if step is not None:
                ax.axvline(0.1 * step, color="tab:red", linestyle="--", label="10% of the engine's greedy step")
                ax.set_title(f"{kind} logits, batch {batch} (greedy engine step {step:.0f} ms)", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--engine", default=None, help="engine directory: also time its greedy and sampling decode steps")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's by default)")
    ap.add_argument("--steps", type=int, default=200, help="timed calls per entry (the old top-p: a fifth of them)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps per engine generate")
    ap.add_argument("--rounds", type=int, default=3, help="engine: times each of its three runs is repeated")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()  # other work on the machine slows both columns; recorded beside the numbers
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("lm", "flat"):
        for batch in args.batches:
            pool = [make_logits(kind, batch, args.vocab, rng) for _ in range(8)]
            sizes = nucleus_sizes(pool)
            for name, kw in CONFIGS.items():
                cfg = GenerationConfig(**kw)
                after, after_min = time_selection(select_next, pool, cfg, args.steps)
                slow = kw.get("top_p", 1.0) < 1.0
                before, before_min = time_selection(old_select_next, pool, cfg, max(10, args.steps // 5) if slow
                                                    else args.steps)
                rows.append({"logits": kind, "batch": batch, "config": name, "before_ms": round(before, 3),
                             "before_min_ms": round(before_min, 3), "after_ms": round(after, 3),
                             "after_min_ms": round(after_min, 3), "speedup": round(before / after, 1),
                             "nucleus_top_p_0.9": {"median": int(np.median(sizes)), "max": max(sizes)}})
                print(f"{kind} batch {batch} {name}: before {before:.3f} ms, after {after:.3f} ms", flush=True)
    engine = engine_steps(args.engine, args.batches, args.new_tokens, args.rounds) if args.engine else []
    steps = {e["batch"]: e["greedy step_ms"] for e in engine}
    print("\n| logits | batch | selection | before ms | after ms | speedup | after / greedy engine step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        share = f"{100 * r['after_ms'] / steps[r['batch']]:.1f}%" if r["batch"] in steps else "-"
        print(f"| {r['logits']} | {r['batch']} | {r['config']} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | "
              f"{r['speedup']}x | {share} |")
    if engine:
        print("\n| batch | engine greedy step ms | top_p=0.9 step ms (after) | top_p=0.9 step ms (before) |")
        print("|---|---|---|---|")
        for e in engine:
            print(f"| {e['batch']} | {e['greedy step_ms']} | {e['top_p=0.9 step_ms']} | "
                  f"{e['top_p=0.9 before step_ms']} |")
    RESULTS.mkdir(exist_ok=True)
    out = result_path("sampling")
    load = {"before": [round(v, 2) for v in load_before], "after": [round(v, 2) for v in os.getloadavg()]}
    out.write_text(json.dumps({"machine": machine_info(), "load_average_1_5_15_min": load,
                               "date": time.strftime("%Y-%m-%d"), "vocab": args.vocab,
                               "steps": args.steps, "engine": args.engine, "selection": rows, "engine_steps": engine},
                              indent=2))
    chart(rows, engine, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
