"""Shared measuring rule of the peer workers (standard library only: each worker runs in its peer's own venv).

A worker supplies ``gen(n) -> (first_s, total_s, row0_new_token_ids)``; ``first_s`` is the time to the first new token
inside that call, or None when the peer cannot tell it (then the median one-token call stands in, as for eager).
TTFT is the best of ``repeats`` one-token calls; decode tok/s counts every row of the batch, tokens after the first
over the time after the first, best of 3 calls: the rule ``trtinfer.bench`` applies to trtinfer and eager.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
from collections.abc import Callable
from typing import Any

Gen = Callable[[int], tuple[float | None, float, list[int]]]


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="JSON file: the prompt's token ids")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    with open(a.ids) as f:
        a.prompt = [int(t) for t in json.load(f)]
    return a


def peak_mib() -> float:
    """This process's peak RSS: VmHWM (ru_maxrss would carry the parent's peak over into a child it started)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure(system: str, version: str, a: argparse.Namespace, gen: Gen, **extra: Any) -> dict[str, Any]:
    """The figures of ``gen`` under the rule above, as the dict ``trtinfer.bench.BenchResult`` holds."""
    gen(4)  # warm-up
    ones = [gen(1)[1] for _ in range(a.repeats)]
    rates, first = [], []
    for _ in range(3):
        f, total, toks = gen(a.new_tokens)
        f = statistics.median(ones) if f is None else f
        rates.append(a.bs * (a.new_tokens - 1) / (total - f))
        first = toks[:8]
    return {"system": system, "version": version, "batch_size": a.bs, "prompt_len": len(a.prompt),
            "new_tokens": a.new_tokens, "ttft_ms": min(ones) * 1000.0, "decode_tok_s": max(rates),
            "peak_rss_mib": peak_mib(),
            "first_tokens": [int(t) for t in first], **extra}


def report(system: str, version: str, a: argparse.Namespace, gen: Gen, **extra: Any) -> None:
    print(json.dumps(measure(system, version, a, gen, **extra)))
