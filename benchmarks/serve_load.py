"""Load on ``trtinfer serve``: concurrent streaming clients at concurrency 1, 4, 8, 16 (the ``openai`` client).

usage: python -m benchmarks.serve_load [--engine DIR | --model smollm2-135m] [--levels 1 4 8 16] [--requests 2]
                                       [--max-tokens 64]

Starts ``trtinfer serve`` as its own process on loopback, then for each concurrency level C runs C client threads,
each sending ``--requests`` streamed chat requests in a row (ragged questions, greedy, ``ignore_eos`` so every
request makes ``--max-tokens`` tokens). Per request: TTFT (send -> first chunk with text; the role chunk before it
is sent at once, even while the request waits for a slot) and inter-token latencies two ways: ITL, the gaps between
chunks with text (a token whose text is held back, a special token such as ``<|im_end|>`` or half a UTF-8 character,
merges two gaps: 7 of SmolLM2's 64 tokens in these answers), and token ITL, the gaps between tokens (the request
asks for ``continuous_usage_stats``, so each chunk says how many tokens it brought: trtinfer sends a chunk per token
then; a server that does not gives no token ITL). Tokens from the usage; per level: p50/p99 of TTFT and both
ITLs, generated tokens/s and requests/s over the level's wall time, errors. Each streamed text is checked against the same request sent alone before the load (greedy: it must
not depend on its batch neighbours). Prints a table, writes benchmarks/results/serve_load.json and .png.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import openai

from benchmarks.machine import machine_info, result_path
from benchmarks.serve_soak import QUESTIONS, start_server

RESULTS = Path(__file__).parent / "results"


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of xs, by nearest rank; nan when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def stream_one(client: openai.OpenAI, question: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: its text, TTFT, inter-token gaps between text chunks and per token (seconds)."""
    t0 = time.perf_counter()
    times, parts = [], []
    arrivals: list[tuple[float, int]] = []  # (time, tokens it added) of each chunk that carried tokens
    stream = client.chat.completions.create(model="load", messages=[{"role": "user", "content": question}],
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True})
    tokens = 0
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            if chunk.choices and chunk.usage.completion_tokens > tokens:
                arrivals.append((now, chunk.usage.completion_tokens - tokens))
            tokens = chunk.usage.completion_tokens
        # text chunks only: the first chunk (the assistant role, empty text) comes before the request has a slot
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(now)
            parts.append(chunk.choices[0].delta.content)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # per token: a chunk that brought k tokens stands for k gaps of 1/k of its wait (a server that sends no usage
    # per chunk gives none; this one sends a chunk per token, text or not, with continuous_usage_stats)
    token_gaps = [(b - a) / k for (a, _), (b, k) in itertools.pairwise(arrivals) for _ in range(k)]
    return {"text": "".join(parts), "ttft": times[0] - t0 if times else float("nan"), "gaps": gaps,
            "token_gaps": token_gaps, "chunks": tokens, "end": time.perf_counter() - t0}


def run_level(client: openai.OpenAI, level: int, per_client: int, max_tokens: int,
              alone: dict[str, str]) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        for k in range(per_client):
            q = QUESTIONS[(c * per_client + k) % len(QUESTIONS)]
            try:
                r = stream_one(client, q, max_tokens)
                r["same_as_alone"] = r["text"] == alone[q]
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - counted, reported
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    token_gaps = [g for r in results for g in r["token_gaps"]]
    tokens = sum(r["chunks"] for r in results)
    return {"concurrency": level, "requests": len(results), "errors": len(errors), "error_samples": errors[:3],
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "requests_per_s": round(len(results) / wall, 3),
            "ttft_p50_ms": round(pct(ttft, 50) * 1000, 1), "ttft_p99_ms": round(pct(ttft, 99) * 1000, 1),
            "itl_p50_ms": round(pct(gaps, 50) * 1000, 1), "itl_p99_ms": round(pct(gaps, 99) * 1000, 1),
            "token_itl_p50_ms": round(pct(token_gaps, 50) * 1000, 1),
            "token_itl_p99_ms": round(pct(token_gaps, 99) * 1000, 1),
            "same_as_alone": sum(r["same_as_alone"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=None)
    ap.add_argument("--model", default="smollm2-135m", help="built (cached) when --engine is not given")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="results name under benchmarks/results (.json and .png; default "
                    "serve_load_<machine kind>_<date>)")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                    help="more `trtinfer serve` flags (e.g. --prefill-chunk 64), last on the line")
    args = ap.parse_args()
    engine = args.engine
    if engine is None:
        from trtinfer.builder import build

        engine = Path(__file__).parent / ".engines" / f"{args.model}-fp32-cpu"
        if not (engine / "manifest.json").is_file():
            build(args.model, engine, progress=False, overwrite=True)
    proc, url = start_server(engine, model_name="load", extra=args.server_args)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        alone = {q: stream_one(client, q, args.max_tokens)["text"] for q in QUESTIONS}  # also warms up
        levels = [run_level(client, c, args.requests, args.max_tokens, alone) for c in args.levels]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    base = levels[0]["tokens_per_s"]
    print(f"{'clients':>7} {'req':>4} {'err':>4} {'tok/s':>8} {'x 1 client':>10} {'req/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok p50':>8} {'tok p99':>8} {'= alone':>8}")
    for lv in levels:
        print(f"{lv['concurrency']:>7} {lv['requests']:>4} {lv['errors']:>4} {lv['tokens_per_s']:>8.1f} "
              f"{lv['tokens_per_s'] / base:>10.2f} {lv['requests_per_s']:>7.3f} {lv['ttft_p50_ms']:>9.0f} "
              f"{lv['ttft_p99_ms']:>9.0f} {lv['itl_p50_ms']:>8.1f} {lv['itl_p99_ms']:>8.1f} "
              f"{lv['token_itl_p50_ms']:>8.1f} {lv['token_itl_p99_ms']:>8.1f} "
              f"{lv['same_as_alone']:>4}/{lv['requests']}")
    RESULTS.mkdir(exist_ok=True)
    record = {"machine": machine_info(), "engine": str(engine), "max_tokens": args.max_tokens,
              "requests_per_client": args.requests, "server_args": args.server_args, "levels": levels}
    out = RESULTS / f"{args.out}.json" if args.out else result_path("serve_load")
    out.write_text(json.dumps(record, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv["concurrency"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(xs, [lv["tokens_per_s"] for lv in levels], "o-")
    a.set_xlabel("concurrent streaming clients")
    a.set_ylabel("generated tokens/s")
    a.set_title("throughput")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99")):
        b.plot(xs, [lv[key] for lv in levels], "o-", label=label)
    b.set_xlabel("concurrent streaming clients")
    b.set_ylabel("ms")
    b.set_yscale("log")
    b.legend()
    b.set_title("latency")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(statistics.median([lv["tokens_per_s"] for lv in levels]) > 0 and f"wrote {out} and its .png")


if __name__ == "__main__":
    main()
