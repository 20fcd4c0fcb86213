"""Prefix caching on ``trtinfer serve``: a shared system prompt, with and without ``--no-prefix-caching``.

usage: python -m benchmarks.prefix_cache [--engine DIR | --model smollm2-135m] [--system 1000] [--suffix 32]
                                         [--max-tokens 32] [--clients 8] [--requests 3]

The workload of a chat service: every request starts with the same ``--system``-token prompt and ends with its own
``--suffix`` tokens (token-id prompts through the completions API, so the lengths are exact). For each server
(``trtinfer serve`` as its own process on loopback, once with prefix caching, once without; the ``openai`` client):

- TTFT of a miss (a system prompt no row holds: a fresh random one per request) and of a hit (the shared one, after
  one request put it in a row), sequential, streamed, several of each (median);
- throughput: ``--clients`` threads each sending ``--requests`` streamed requests in a row (shared system prompt,
  distinct suffixes, greedy, ``ignore_eos``): generated tokens/s over the wall time, TTFT p50.

Every streamed text is checked: the same request gives the same text on both servers. Prints a table, writes
``benchmarks/results/prefix_cache_<cpu>_<date>.json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from benchmarks.machine import cpu_kind, machine_info
from benchmarks.serve_soak import start_server

RESULTS = Path(__file__).parent / "results"


def stream(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion of token ids: its text, TTFT (s) and token count."""
    t0 = time.perf_counter()
    first, parts = None, []
    for chunk in client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].text)
    return {"text": "".join(parts), "ttft": (first or time.perf_counter()) - t0, "end": time.perf_counter() - t0}


def measure(url: str, system: list[int], suffixes: list[list[int]], misses: list[list[int]], clients: int,
            requests: int, max_tokens: int) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    stream(client, system + suffixes[0], 4)  # warm-up; puts the system prompt in a row
    miss = [stream(client, p, 4)["ttft"] for p in misses]
    hit = [stream(client, system + s, 4)["ttft"] for s in suffixes[1:1 + len(misses)]]
    texts: dict[int, str] = {}
    ttfts: list[float] = []
    lock = threading.Lock()

    def worker(c: int) -> None:
        for r in range(requests):
            i = 1 + c * requests + r
            out = stream(client, system + suffixes[i], max_tokens)
            with lock:
                texts[i] = out["text"]
                ttfts.append(out["ttft"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    metrics = httpx.get(f"{url}/metrics").text
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("trtinfer:prefix_cache_hits_total"))
    return {"ttft_miss_s": statistics.median(miss), "ttft_hit_s": statistics.median(hit),
            "tokens_per_s": clients * requests * max_tokens / wall, "wall_s": wall,
            "ttft_p50_load_s": statistics.median(ttfts), "prefix_cache_hit_tokens": hits, "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, help="an engine directory (default: build --model)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--probes", type=int, default=3, help="sequential misses and hits timed for TTFT")
    args = ap.parse_args()
    engine = args.engine
    if engine is None:
        engine = Path("engines") / args.model
        subprocess.run([sys.executable, "-m", "trtinfer.cli", "build", args.model, "-o", str(engine)], check=True)
    vocab = json.loads((engine / "manifest.json").read_text())["geometry"]["vocab_size"]
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:  # ordinary tokens (clear of the special ids at both ends of the vocabulary)
        return rng.integers(200, vocab - 200, size=n).tolist()

    system = ids(args.system)
    suffixes = [ids(args.suffix) for _ in range(1 + args.clients * args.requests + args.probes)]
    misses = [ids(args.system) + ids(args.suffix) for _ in range(args.probes)]
    rows = {}
    for caching in (True, False):
        proc, url = start_server(engine, "bench", ["--prefix-caching" if caching else "--no-prefix-caching"])
        try:
            rows["prefix caching" if caching else "no prefix caching"] = measure(
                url, system, suffixes, misses, args.clients, args.requests, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(30)
    on, off = rows["prefix caching"], rows["no prefix caching"]
    same = on["texts"] == off["texts"]
    print(f"{'server':<20}{'TTFT miss':>11}{'TTFT hit':>10}{'hit/miss':>9}{f'{args.clients}-client tok/s':>18}"
          f"{'TTFT p50 (load)':>17}")
    for name, r in rows.items():
        print(f"{name:<20}{r['ttft_miss_s']:>10.3f}s{r['ttft_hit_s']:>9.3f}s{r['ttft_hit_s'] / r['ttft_miss_s']:>9.2f}"
              f"{r['tokens_per_s']:>18.1f}{r['ttft_p50_load_s']:>16.3f}s")
    ratio = on["tokens_per_s"] / off["tokens_per_s"]
    print(f"throughput with / without: x{ratio:.2f}; hit TTFT / miss TTFT (caching): "
          f"{on['ttft_hit_s'] / on['ttft_miss_s']:.2f}; same texts on both servers: {same}")
    info = machine_info()
    date = datetime.date.today().isoformat()
    tag = cpu_kind(info)
    out = RESULTS / f"prefix_cache_{tag}_{date}"
    RESULTS.mkdir(exist_ok=True)
    record = {"machine": info, "date": date, "engine": str(engine), "args": vars(args) | {"engine": str(engine)},
              "rows": {k: {kk: vv for kk, vv in v.items() if kk != "texts"} for k, v in rows.items()},
              "throughput_ratio": ratio, "hit_over_miss_ttft": on["ttft_hit_s"] / on["ttft_miss_s"],
              "same_texts": same}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(rows)
    a.bar(["miss", "hit"], [on["ttft_miss_s"], on["ttft_hit_s"]], color=["#999", "#2a7"])
    a.set_ylabel("TTFT (s)")
    a.set_title(f"{args.system}-token system prompt, prefix caching")
    b.bar(names, [rows[n]["tokens_per_s"] for n in names], color=["#2a7", "#999"])
    b.set_ylabel("generated tokens/s")
    b.set_title(f"{args.clients} clients")
    fig.suptitle(f"{engine.name} on {info['cpu']} ({info['cores']} cores), {date}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out}.json and .png")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
