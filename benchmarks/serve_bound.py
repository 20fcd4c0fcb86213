"""How much of its own engine loop ``trtinfer serve`` delivers: guidellm against the server, beside the same workload
driven through the same :class:`~trtinfer.runtime.scheduler.Scheduler` in process (no HTTP, no client), interleaved.

usage: python -m benchmarks.serve_bound --engine [CHECKOUT:]DIR [--engine ...] [--streams 8] [--requests 32]
                                        [--rounds 3] [--prompt-tokens 128] [--output-tokens 64] [--out PATH]
                                        [--serve-arg=--no-spinning ...] [--client guidellm|openai]

A round runs, per engine: (1) ``benchmarks.guidellm_serve`` at ``--streams`` streams (a fresh ``trtinfer serve`` on
loopback, guidellm's synthetic ``--prompt-tokens``-token prompts, ``--output-tokens`` tokens each with
``ignore_eos``, ``--requests`` requests); (2) in a child process, the scheduler the server builds (the
``ServeConfig`` that ``trtinfer serve`` makes of the same ``--serve-arg`` flags: slots, prefill chunk, prefix
caching, runtime settings) with ``--streams`` threads each submitting a prompt of ``--prompt-tokens`` random token
ids (seeded; no two share a prefix, as guidellm's) as soon as its last one ended, ``--requests`` in all, after one
warm-up request: output tokens over the wall time, TTFT p50 (submit -> first token). The in-process run is the server
without its HTTP layer and without a client on the same cores: the ratio served / in-process says what the server and
its client cost, and what is left for the loop to win is the model's step (see ``benchmarks.loop_overhead`` for the
loop's host time per step). ``--client openai`` drives the server with a lighter client instead of guidellm:
``--streams`` threads of the ``openai`` package, each streaming ``/v1/completions`` with the in-process side's
prompts (the same random token ids), ``ignore_eos``, greedy; tokens from the usage of each stream's last chunk, TTFT
to the first chunk. ``--engine CHECKOUT:DIR`` serves ``DIR`` with another trtinfer checkout's server (an earlier
commit: ``git worktree add``; ``--client openai`` only, served side only: its scheduler is not this one), so the same
light load compares two commits round by round.

Writes PATH.json (machine, each run, a summary per engine: tok/s and TTFT p50 of both, served / in-process per round)
and PATH.png (default PATH: benchmarks/results/serve_bound_<cpu kind>_<date>); prints the table. guidellm runs from
``~/glvenv`` (``benchmarks.guidellm_serve --guidellm``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.guidellm_ab import one_run, runs_chart
from benchmarks.machine import ROOT, git_commit, machine_info, result_path


def serve_config(engine_dir: Path, serve_args: Sequence[str]) -> Any:
    """The ``ServeConfig`` that ``trtinfer serve ENGINE SERVE_ARGS`` runs with."""
    from trtinfer.cli.serve import add_parser, config_from_args

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return config_from_args(sub.choices["serve"].parse_args([str(engine_dir), *serve_args]))


def closed_loop(prompts: list[list[int]], streams: int, one: Callable[[list[int]], tuple[float, int]]
                ) -> tuple[dict[str, Any], list[int]]:
    """``streams`` threads, each sending the next of ``prompts`` through ``one`` (-> TTFT in seconds, tokens made) as
    soon as its last one ended: (output tok/s over the wall time, TTFT p50 ms, wall, requests, tokens; the tokens
    each request made)."""
    todo, lock = iter(prompts), threading.Lock()
    done: list[tuple[float, int]] = []

    def worker() -> None:
        while True:
            with lock:
                prompt = next(todo, None)
            if prompt is None:
                return
            result = one(prompt)
            with lock:
                done.append(result)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(n for _, n in done)
    return ({"output_tokens_per_s": round(tokens / wall, 2),
             "ttft_p50_ms": round(statistics.median(f for f, _ in done) * 1e3, 1), "wall_s": round(wall, 2),
             "requests": len(done), "output_tokens": tokens}, [n for _, n in done])


def in_process(engine_dir: Path, streams: int, requests: int, prompt_tokens: int, output_tokens: int,
               serve_args: Sequence[str] = ()) -> dict[str, Any]:
    """The workload through the server's scheduler in this process: output tok/s, TTFT p50 (ms), steps."""
    from trtinfer.runtime.config import GenerationConfig
    from trtinfer.serving.app import load_engine

    config = serve_config(engine_dir, serve_args)
    with load_engine(engine_dir, config) as engine:
        prompts = prompt_set(int(engine.manifest.geometry["vocab_size"]), requests, prompt_tokens)
        cfg = GenerationConfig(max_new_tokens=output_tokens, ignore_eos=True)
        scheduler = config.scheduler(engine).start()

        def one(prompt: list[int]) -> tuple[float, int]:
            t0, first, n = time.perf_counter(), float("nan"), 0
            for event in scheduler.submit(prompt, cfg):
                first = time.perf_counter() - t0 if n == 0 else first
                n += event.token_id is not None
            return first, n

        try:
            one(prompts[-1])  # warm-up, as guidellm_serve sends one request first
            steps0 = scheduler.stats()["steps"]
            report, _ = closed_loop(prompts[:-1], streams, one)
            report["steps"] = scheduler.stats()["steps"] - steps0
        finally:
            scheduler.close()
    return report


def prompt_set(vocab: int, requests: int, prompt_tokens: int) -> list[list[int]]:
    """``requests`` prompts and one for the warm-up (the last): random token ids, seeded, the same for every side."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(requests + 1)]


def openai_load(engine_dir: Path, streams: int, requests: int, prompt_tokens: int, output_tokens: int,
                serve_args: Sequence[str] = (), checkout: Path | None = None) -> dict[str, Any]:
    """The workload against ``trtinfer serve`` from ``streams`` threads of the openai client: output tok/s, TTFT p50."""
    import openai

    from benchmarks.serve_soak import start_server

    # the JSON, not trtinfer's manifest reader: the engine may be an earlier commit's build (``--engine CHECKOUT:DIR``)
    vocab = int(json.loads((engine_dir / "manifest.json").read_text())["geometry"]["vocab_size"])
    prompts = prompt_set(vocab, requests, prompt_tokens)
    proc, url = start_server(engine_dir, "bound", list(serve_args), cwd=checkout)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def one(prompt: list[int]) -> tuple[float, int]:
            t0, first, made = time.perf_counter(), None, 0
            for chunk in client.completions.create(model="bound", prompt=prompt, max_tokens=output_tokens,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True},
                                                   stream_options={"include_usage": True}):
                if chunk.choices and first is None:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    made = chunk.usage.completion_tokens
            return float("nan") if first is None else first, made

        one(prompts[-1])  # warm-up
        report, made = closed_loop(prompts[:-1], streams, one)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {**report, "checks": {"all_output_tokens_exact": all(n == output_tokens for n in made)}}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per engine: tok/s and TTFT p50 of each side by round, their means, served / in-process per round."""
    summary: dict[str, Any] = {}
    for r in runs:
        e = summary.setdefault(r["engine"], {"served_tok_s": [], "in_process_tok_s": [], "served_ttft_p50_ms": [],
                                            "in_process_ttft_p50_ms": []})
        e[f"{r['side']}_tok_s"].append(r["output_tokens_per_s"])
        e[f"{r['side']}_ttft_p50_ms"].append(r["ttft_p50_ms"])
    for e in summary.values():
        e["ratio_by_round"] = [round(a / b, 3) for a, b in zip(e["served_tok_s"], e["in_process_tok_s"], strict=False)]
        if e["in_process_tok_s"]:  # none for another checkout's server
            e["ratio_of_means"] = round(statistics.mean(e["served_tok_s"]) / statistics.mean(e["in_process_tok_s"]),
                                        3)
    return summary


def label(engine: str) -> str:
    """A summary key's short name: the engine folder's, after its checkout's where it has one."""
    checkout, _, path = engine.rpartition(":")
    return f"{Path(checkout).name}:{Path(path).name}" if checkout else Path(path).name


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'engine':<28} {'served tok/s':<24} {'in-process tok/s':<24} {'served/in-process':<22} "
          f"{'TTFT p50 ms served / in-process'}")

    def runs(values: list[float]) -> str:
        return ", ".join(f"{v:.1f}" for v in values) or "-"

    def mean(values: list[float]) -> str:
        return f"{statistics.mean(values):.0f}" if values else "-"

    for engine, e in summary.items():
        print(f"{label(engine):<28} {runs(e['served_tok_s']):<24} {runs(e['in_process_tok_s']):<24} "
              f"{', '.join(map(str, e['ratio_by_round'])) or '-':<22} "
              f"{mean(e['served_ttft_p50_ms'])} / {mean(e['in_process_ttft_p50_ms'])}")


def chart(summary: dict[str, Any], title: str, path: Path) -> None:
    bars = [(f"{label(e)}\n{side.replace('_', '-')}", "tab:gray" if side == "served" else "tab:blue",
             s[f"{side}_tok_s"], s[f"{side}_ttft_p50_ms"])
            for e, s in summary.items() for side in ("served", "in_process") if s[f"{side}_tok_s"]]
    runs_chart(bars, title, path, tick_size=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="append", required=True, help="[CHECKOUT:]ENGINE_DIR")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the child's side of one round
    ap.add_argument("--out", type=Path, default=None, help="output path without suffix")
    ap.add_argument("--serve-arg", action="append", default=[], help="a trtinfer serve flag for both sides "
                    "(--serve-arg=--no-spinning)")
    ap.add_argument("--client", choices=("guidellm", "openai"), default="guidellm",
                    help="the served side's load client (default guidellm)")
    args = ap.parse_args()
    if args.in_process:
        print(json.dumps(in_process(Path(args.engine[0]), args.streams, args.requests, args.prompt_tokens,
                                    args.output_tokens, args.serve_arg)))
        return
    engines: list[tuple[Path | None, Path]] = []
    for text in args.engine:
        checkout, _, path = text.rpartition(":")
        engine = Path(path).expanduser().resolve()
        if not (engine / "manifest.json").is_file():
            ap.error(f"--engine {text}: no manifest.json in {engine}; build one with trtinfer build")
        if checkout and not (Path(checkout) / "trtinfer").is_dir():
            ap.error(f"--engine {text}: {checkout} is not a trtinfer checkout")
        if checkout and args.client != "openai":
            ap.error(f"--engine {text}: another checkout's server runs with --client openai only")
        engines.append((Path(checkout).resolve() if checkout else None, engine))
    machine = machine_info()
    out = (args.out or result_path("serve_bound", "", machine)).resolve()
    work = out.with_name(out.name + "_runs")
    if args.client == "guidellm":  # each guidellm run's record and log
        work.mkdir(parents=True, exist_ok=True)
    gl_args = argparse.Namespace(levels=[args.streams], requests_per_level=args.requests)
    runs = []
    for rnd in range(1, args.rounds + 1):
        for checkout, engine in engines:
            key = f"{checkout}:{engine}" if checkout else str(engine)
            if args.client == "openai":
                print(f"--- served {label(key)}", flush=True)
                runs.append({"engine": key, "side": "served", "round": rnd,
                             **openai_load(engine, args.streams, args.requests, args.prompt_tokens,
                                           args.output_tokens, args.serve_arg, checkout)})
            else:
                record = one_run(f"served-{engine.name}", ROOT, engine, args.serve_arg, gl_args,
                                 work / f"{engine.name}-{rnd}")
                level = record["levels"][0]
                runs.append({"engine": key, "side": "served", "round": rnd,
                             "output_tokens_per_s": level["output_tokens_per_s"],
                             "ttft_p50_ms": level["ttft_p50_ms"], "checks": record["checks"]})
            if checkout:  # its scheduler is not this one: served only
                print(runs[-1], flush=True)
                continue
            cmd = [sys.executable, "-m", "benchmarks.serve_bound", "--in-process", "--engine", str(engine),
                   "--streams", str(args.streams), "--requests", str(args.requests),
                   "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
                   *(f"--serve-arg={a}" for a in args.serve_arg)]
            print(f"--- in-process {engine.name}", flush=True)
            child = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
            runs.append({"engine": key, "side": "in_process", "round": rnd,
                         **json.loads(child.stdout.strip().splitlines()[-1])})
            print(runs[-2]["output_tokens_per_s"], runs[-1], flush=True)
    summary = summarize(runs)
    print_table(summary)
    record = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "code": git_commit(ROOT),
              "streams": args.streams, "requests": args.requests, "rounds": args.rounds,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "serve_args": args.serve_arg,
              "client": args.client, "checkouts": {str(c): git_commit(c) for c, _ in engines if c},
              "command": [sys.executable, *sys.argv], "runs": runs, "summary": summary}
    json_path, png_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".png")
    json_path.write_text(json.dumps(record, indent=1))
    chart(summary, f"trtinfer serve ({args.client}, {args.streams} streams) vs its scheduler in process, "
          f"{git_commit(ROOT)}", png_path)
    print(f"wrote {json_path}, {png_path}")


if __name__ == "__main__":
    main()
