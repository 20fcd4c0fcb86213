"""Soak test of ``trtinfer serve``: 1,000 requests through the ``openai`` client; nothing lost, memory flat.

usage: python -m benchmarks.serve_soak [--engine DIR | --model smollm2-135m] [--requests 1000] [--concurrency 16]

Starts ``trtinfer serve`` as its own process on loopback (its resident memory is read from /proc), then sends
``--requests`` requests from ``--concurrency`` client threads: completions and chat, whole and streamed, ragged
prompts, a few with ``n=2``, a few with a stop string. Mixed in (each ~3%): bad requests (must get a 4xx) and
clients that leave mid-stream (their slots must free). Every greedy answer is compared with ``engine.generate`` of
its prompt alone in this process; a request counts as lost when it fails, ends without a finish reason, or its
text differs. RSS is sampled every 50 requests; growth is measured from the end of warm-up (the first 10%) to the
end. At the end the server's /metrics must show no request running or waiting. Writes
benchmarks/results/serve_soak.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

import trtinfer
from benchmarks.machine import machine_info, result_path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Hi",
             "Explain in two sentences why the sky is blue, for a child who asked at breakfast.",
             "List three prime numbers.", "def fibonacci(n):", "Translate 'good morning' into Spanish.",
             "Summarize the plot of Romeo and Juliet in one paragraph, naming the families and the ending."]


def rss_kib(pid: int) -> int:
    """Resident set size of a process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(engine: Path, model_name: str = "soak", extra: list[str] | None = None,
                 cwd: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    """``trtinfer serve ENGINE --port 0 [extra flags]`` as a child; its base URL once /health answers 200. ``cwd``: a
    trtinfer checkout whose server to start (``python -m`` imports the package of its working directory)."""
    proc = subprocess.Popen([sys.executable, "-m", "trtinfer.cli", "serve", str(engine), "--port", "0",
                             "--model-name", model_name, *(extra or [])], stderr=subprocess.PIPE, text=True, cwd=cwd)
    assert proc.stderr is not None
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", proc.stderr.readline())
    if not m:
        proc.kill()
        raise RuntimeError("the server did not say where it listens")
    url = f"http://127.0.0.1:{m.group(1)}"
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("the server did not become ready")
        time.sleep(0.1)


def plan(i: int) -> dict[str, Any]:
    """Request ``i`` of the soak: what kind and with which prompt (deterministic)."""
    q = QUESTIONS[i % len(QUESTIONS)]
    kind = ("bad" if i % 37 == 5 else "leave" if i % 31 == 7 else
            ["completion", "chat", "completion-stream", "chat-stream"][i % 4])
    return {"i": i, "kind": kind, "q": q, "max_tokens": 8 + (i * 7) % 17, "n": 2 if i % 10 == 3 else 1,
            "stop": i % 10 == 6}


def run_one(client: openai.OpenAI, url: str, p: dict[str, Any]) -> dict[str, Any]:
    """Send one planned request; what came back."""
    t0 = time.perf_counter()
    kw: dict[str, Any] = {"model": "soak", "max_tokens": p["max_tokens"], "temperature": 0, "n": p["n"]}
    if p["stop"]:
        kw["stop"] = ["."]
    messages = [{"role": "user", "content": p["q"]}]
    out: dict[str, Any] = {"kind": p["kind"], "texts": None, "finish": None}
    if p["kind"] == "bad":
        out["status"] = httpx.post(f"{url}/v1/completions", json={"model": "soak", "prompt": p["q"],
                                                                   "temperature": -1}).status_code
    elif p["kind"] == "leave":
        body = {"model": "soak", "prompt": p["q"], "max_tokens": 64, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            next(resp.iter_lines())
        out["status"] = resp.status_code
    elif p["kind"] == "completion":
        whole = client.completions.create(prompt=p["q"], **kw)
        out["texts"], out["finish"] = [c.text for c in whole.choices], [c.finish_reason for c in whole.choices]
    elif p["kind"] == "chat":
        r = client.chat.completions.create(messages=messages, **kw)  # type: ignore[arg-type]
        out["texts"] = [c.message.content for c in r.choices]
        out["finish"] = [c.finish_reason for c in r.choices]
    else:
        chat = p["kind"] == "chat-stream"
        stream: Any = (client.chat.completions.create(messages=messages, stream=True, **kw) if chat  # type: ignore[arg-type]
                       else client.completions.create(prompt=p["q"], stream=True, **kw))
        texts: list[str] = [""] * p["n"]
        finish: list[Any] = [None] * p["n"]
        for ch in stream:
            for c in ch.choices:
                texts[c.index] += (c.delta.content or "") if chat else c.text
                finish[c.index] = c.finish_reason or finish[c.index]
        out["texts"], out["finish"] = texts, finish
    out["seconds"] = time.perf_counter() - t0
    return out


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of one metric in a Prometheus exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=None, help="engine directory (default: build --model)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args(argv)
    engine = args.engine
    if engine is None:
        from trtinfer.builder import build

        engine = HERE / ".engines" / f"{args.model}-fp32-cpu"  # shared with the other benchmarks
        if not (engine / "manifest.json").is_file():
            build(args.model, engine, overwrite=True, progress=False)
    plans = [plan(i) for i in range(args.requests)]
    with trtinfer.load(engine) as ref:  # each greedy answer alone, once per distinct request
        m = ref.manifest
        engine_info = {"architecture": m.raw.get("architecture"), "source": str(m.raw.get("source")),
                       "precision": m.raw.get("precision"), "max_batch_size": m.max_batch_size,
                       "max_seq_len": m.max_seq_len}
        want: dict[tuple[Any, ...], tuple[str, str]] = {}
        for p in plans:
            if p["kind"] in ("bad", "leave"):
                continue
            chat = p["kind"].startswith("chat")
            key = (chat, p["q"], p["max_tokens"], p["stop"])
            if key not in want:
                r = ref.generate([[{"role": "user", "content": p["q"]}] if chat else p["q"]], chat=chat,
                                 max_new_tokens=p["max_tokens"], do_sample=False, stop=["."] if p["stop"] else None)[0]
                want[key] = (r.text, r.finish_reason)

    proc, url = start_server(engine)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    samples: list[tuple[int, int]] = [(0, rss_kib(proc.pid))]
    lost: list[str] = []
    kinds: Counter[str] = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    done = 0
    t0 = time.perf_counter()

    def task(p: dict[str, Any]) -> None:
        nonlocal done
        try:
            out = run_one(client, url, p)
        except Exception as e:  # noqa: BLE001 - a failed request is a lost one, counted below
            out = {"kind": p["kind"], "error": f"{type(e).__name__}: {e}"}
        with lock:
            kinds[p["kind"]] += 1
            done += 1
            if done % 50 == 0:
                samples.append((done, rss_kib(proc.pid)))
            if "error" in out:
                lost.append(f"request {p['i']} ({p['kind']}): {out['error']}")
            elif p["kind"] == "bad":
                if out["status"] != 400:
                    lost.append(f"request {p['i']}: bad request answered {out['status']}")
            elif p["kind"] == "leave":
                if out["status"] != 200:
                    lost.append(f"request {p['i']}: stream answered {out['status']}")
            else:
                latencies.append(out["seconds"])
                text, finish = want[(p["kind"].startswith("chat"), p["q"], p["max_tokens"], p["stop"])]
                if out["texts"] != [text] * p["n"] or out["finish"] != [finish] * p["n"]:
                    lost.append(f"request {p['i']} ({p['kind']}): got {out['texts']!r} {out['finish']}, want "
                                f"{text!r} {finish}")

    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(task, plans))
        elapsed = time.perf_counter() - t0
        time.sleep(0.5)  # the last cancelled streams retire at the scheduler's next step
        metrics = httpx.get(f"{url}/metrics").text
        samples.append((done, rss_kib(proc.pid)))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    warm_at = max(1, args.requests // 10)
    warm = next(kib for n, kib in samples if n >= warm_at)
    final = samples[-1][1]
    peak_after_warm = max(kib for n, kib in samples if n >= warm_at)
    finished = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'trtinfer:request_success_total\{finished_reason="(\w+)"[^}]*\} (\S+)', metrics)}
    result = {
        "machine": machine_info(), "engine": str(engine), "engine_info": engine_info,
        "load_average_1_5_15_min": list(os.getloadavg()), "requests": args.requests,
        "concurrency": args.concurrency, "kinds": dict(kinds), "lost": len(lost), "lost_examples": lost[:5],
        "seconds": round(elapsed, 1), "requests_per_s": round(args.requests / elapsed, 2),
        "latency_p50_s": round(sorted(latencies)[len(latencies) // 2], 3) if latencies else None,
        "latency_p99_s": round(sorted(latencies)[int(len(latencies) * 0.99)], 3) if latencies else None,
        "rss_start_mib": round(samples[0][1] / 1024, 1), "rss_after_warmup_mib": round(warm / 1024, 1),
        "rss_end_mib": round(final / 1024, 1), "rss_peak_after_warmup_mib": round(peak_after_warm / 1024, 1),
        "rss_growth_after_warmup_pct": round((final - warm) / warm * 100, 2),
        "rss_samples_kib": samples,
        "metrics_end": {"running": metric_sum(metrics, "trtinfer:num_requests_running"),
                        "waiting": metric_sum(metrics, "trtinfer:num_requests_waiting"),
                        "request_success_total": finished,
                        "generation_tokens_total": metric_sum(metrics, "trtinfer:generation_tokens_total")},
        "server_exit_code": proc.returncode,
    }
    print("\n| requests | lost | bad->400 | left mid-stream | req/s | p50 s | p99 s | RSS after warm-up MiB | "
          "RSS end MiB | growth | running/waiting at end |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.requests} | {len(lost)} | {kinds['bad']} | {kinds['leave']} | {result['requests_per_s']} | "
          f"{result['latency_p50_s']} | {result['latency_p99_s']} | {result['rss_after_warmup_mib']} | "
          f"{result['rss_end_mib']} | {result['rss_growth_after_warmup_pct']:+.2f}% | "
          f"{result['metrics_end']['running']:.0f}/{result['metrics_end']['waiting']:.0f} |")
    print(f"finished by reason (server metrics): {finished}; server exit code {proc.returncode}")
    for line in lost[:5]:
        print("lost:", line)
    RESULTS.mkdir(exist_ok=True)
    out = result_path("serve_soak")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if lost or result["rss_growth_after_warmup_pct"] > 5:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
