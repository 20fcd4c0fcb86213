"""Load on ``trtinfer serve`` measured by guidellm (the vLLM project's load tool), at concurrency 1, 4, 8, 16.

usage: python -m benchmarks.guidellm_serve --engine DIR [--levels 1 4 8 16] [--requests-per-level 16]
                                           [--max-seconds 120] [--prompt-tokens 128] [--output-tokens 64]
                                           [--api completions|chat] [--guidellm ~/glvenv/bin/guidellm]
                                           [--tokenizer DIR] [--client-processes 1] [--serve-arg=--max-slots=16 ...]

Starts ``python -m trtinfer.cli serve DIR --port 0`` as a child (as ``serve_soak.start_server`` does: the port from
its first stderr line, then /health), sends one short request to warm it up, then runs guidellm once, from its own
virtual environment (``--guidellm``), with everything it would otherwise fetch from the Hugging Face hub made local:
``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1`` and the tokenizer from the engine folder
(tokenizer.json), which guidellm uses to make synthetic prompts of exactly ``--prompt-tokens`` tokens. Profile
``concurrent`` with ``--override profile.streams 1,4,8,16`` (one sub-benchmark per level, C streams each sending a
request as soon as the last one ends); every level stops at ``--requests-per-level`` requests or ``--max-seconds``.
guidellm asks for ``max_tokens`` = ``--output-tokens`` with ``ignore_eos`` and ``stop: null``, streamed, with
``stream_options.include_usage`` and ``continuous_usage_stats``; its token counts come from the server's usage.
Default ``--api completions`` (/v1/completions): the prompt is then exactly ``--prompt-tokens`` tokens (plus BOS
where the tokenizer adds one); with ``chat`` the chat template adds its tokens. The server decodes at most
``--max-slots`` requests at once (default: the engine's max batch size, at most 8), so at 16 streams half of them
queue unless ``--serve-arg=--max-slots=16``. guidellm runs on the same machine: ``--client-processes`` (default 1,
asyncio streams in one process) keeps it from taking more cores than it needs away from the server.

guidellm's metrics, per level: TTFT = request sent -> first streamed chunk with text; ITL = per request,
(last text chunk - first text chunk) / (output tokens - 1), percentiles over requests (not over single gaps, as
``serve_load.py`` does; text the server holds back, e.g. half a UTF-8 character, merges chunks); request
latency = sent -> stream end; output tokens/s = the level's output tokens over its duration. Checks: every
completed request made ``--output-tokens`` tokens from a ``--prompt-tokens`` prompt (from the server's usage), and
the server's own /metrics counters (``trtinfer:generation_tokens``, finished requests) moved by what guidellm
counted (not compared when a level cut requests off at ``--max-seconds``).

Writes benchmarks/results/guidellm_<cpu-tag>_<date>.json (machine, engine, guidellm version, the exact guidellm
command, per-level table, checks) and .png; guidellm's own JSON report beside them as ``..._raw.json.gz`` and its
log as ``.log``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.machine import cpu_kind, git_commit, machine_info

RESULTS = Path(__file__).parent / "results"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
MODEL_NAME = "bench"


def start_server(engine: Path, extra: list[str]) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``trtinfer serve ENGINE --port 0 [extra]`` as a child: it, its base URL once /health answers 200, and the
    list its stderr lines keep going into (``serve_soak.start_server`` with extra serve arguments)."""
    proc = subprocess.Popen([sys.executable, "-m", "trtinfer.cli", "serve", str(engine), "--port", "0",
                             "--model-name", MODEL_NAME, *extra], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    first = proc.stderr.readline()
    lines = [first.rstrip()]
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", first)
    if not m:
        proc.kill()
        raise RuntimeError(f"the server did not say where it listens: {first!r}")
    url = f"http://127.0.0.1:{m.group(1)}"
    stderr = proc.stderr

    def drain() -> None:  # keep reading: a full pipe would block the server
        for x in stderr:
            lines.append(x.rstrip())

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url, lines
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("the server did not become ready:\n" + "\n".join(lines[-20:]))
        time.sleep(0.1)


def server_counters(url: str) -> dict[str, float]:
    """The server's token and finished-request counters from /metrics (Prometheus text)."""
    counters: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r'trtinfer:(generation_tokens_total|prompt_tokens_total|request_success_total)(\{[^}]*\})? (\S+)',
                     line)
        if m:
            reason = re.search(r'finished_reason="(\w+)"', m.group(2) or "")
            key = m.group(1) + (f":{reason.group(1)}" if reason else "")
            counters[key] = counters.get(key, 0.0) + float(m.group(3))
    return counters


def guidellm_env(processes: int | None = None) -> dict[str, str]:
    """The environment guidellm runs in: offline, and at most ``processes`` client worker processes."""
    extra = {} if processes is None else {"GUIDELLM__MAX_WORKER_PROCESSES": str(processes)}
    return {**os.environ, **OFFLINE, **extra}


def guidellm_version(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, env=guidellm_env(), check=True).stdout
    m = re.search(r"version:?\s*(\S+)", out)
    return m.group(1) if m else out.strip()


def guidellm_command(exe: str, url: str, tokenizer: Path, raw: Path, args: argparse.Namespace) -> list[str]:
    """``guidellm run`` for every level in one go; each option a JSON object (guidellm parses JSON, YAML or
    key=value)."""
    route = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[args.api]
    spec = {
        "--backend": {"kind": "openai_http", "target": url, "model": MODEL_NAME, "request_format": route,
                      "timeout": float(args.max_seconds + 60)},
        "--profile": {"kind": "concurrent"},
        "--data": {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens},
        "--tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "--output": {"kind": "json", "path": str(raw)},
    }
    cmd = [exe, "run"]
    for flag, value in spec.items():
        cmd += [flag, json.dumps(value, separators=(",", ":"))]
    cmd += ["--override", "profile.streams", ",".join(str(c) for c in args.levels)]
    for constraint in ({"kind": "max_requests", "count": args.requests_per_level},
                       {"kind": "max_duration", "seconds": args.max_seconds}):
        cmd += ["--constraint", json.dumps(constraint, separators=(",", ":"))]
    return [*cmd, "--disable-console"]  # progress as log lines (to our stdout and the .log), no rich tables


def run_guidellm(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    """Run guidellm, its output both printed (prefixed) and written to ``log``; its exit status."""
    with log.open("w") as f:
        f.write(shlex.join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                f.write(line)
                print(f"  [guidellm] {line.rstrip()}", flush=True)
            return proc.wait()
        finally:
            timer.cancel()


def stat(metrics: dict[str, Any], name: str, q: str, digits: int = 2) -> float:
    """A percentile (``p50``, ``p99``) or ``mean`` of guidellm's distribution ``name`` over successful requests."""
    d = (metrics.get(name) or {}).get("successful") or {}
    if not d.get("count"):
        return float("nan")
    v = d["mean"] if q == "mean" else d["percentiles"][q]
    return round(v, digits)


def summarize(report: dict[str, Any], prompt_tokens: int, output_tokens: int,
              exact_prompt: bool = True) -> list[dict[str, Any]]:
    """One row per guidellm sub-benchmark (concurrency level)."""
    levels = []
    for b in report["benchmarks"]:
        m, reqs = b["metrics"], b["requests"]
        ok = reqs.get("successful") or []
        out_counts = sorted({r.get("output_tokens") for r in ok}, key=str)
        in_counts = sorted({r.get("prompt_tokens") for r in ok}, key=str)
        totals = m["request_totals"]
        errors = [(r.get("info") or {}).get("error") for r in reqs.get("errored") or []]
        levels.append({
            "concurrency": b["config"]["strategy"]["streams"],
            "requests": totals["successful"], "errors": totals["errored"], "incomplete": totals["incomplete"],
            "error_samples": [e for e in errors if e][:3],
            "duration_s": round(b["duration"], 3),
            "output_tokens": sum(r.get("output_tokens") or 0 for r in ok),
            "output_tokens_per_s": round(m["output_tokens_per_second"]["total"]["mean"], 2),
            "requests_per_s": round(m["requests_per_second"]["total"]["mean"], 3),
            "ttft_p50_ms": stat(m, "time_to_first_token_ms", "p50"),
            "ttft_p99_ms": stat(m, "time_to_first_token_ms", "p99"),
            "itl_p50_ms": stat(m, "inter_token_latency_ms", "p50"),
            "itl_p99_ms": stat(m, "inter_token_latency_ms", "p99"),
            "tpot_p50_ms": stat(m, "time_per_output_token_ms", "p50"),
            "latency_p50_s": stat(m, "request_latency", "p50", 4),
            "latency_p99_s": stat(m, "request_latency", "p99", 4),
            "output_tokens_per_chunk_mean": stat(m, "output_tokens_per_iteration", "mean"),
            "output_token_counts": out_counts, "prompt_token_counts": in_counts,
            "all_output_tokens_exact": bool(ok) and out_counts == [output_tokens],
            # with a chat template the prompt is longer than the synthetic text: only checked without one
            "all_prompt_tokens_exact": (bool(ok) and in_counts == [prompt_tokens]) if exact_prompt else None,
        })
    return levels


def print_table(levels: list[dict[str, Any]], output_tokens: int) -> None:
    print(f"{'streams':>7} {'req':>4} {'err':>4} {'inc':>4} {'out tok/s':>9} {'req/s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'lat p50 s':>9} {'tokens/req':>10}")
    for lv in levels:
        counts = ",".join(str(c) for c in lv["output_token_counts"]) or "-"
        print(f"{lv['concurrency']:>7} {lv['requests']:>4} {lv['errors']:>4} {lv['incomplete']:>4} "
              f"{lv['output_tokens_per_s']:>9.1f} {lv['requests_per_s']:>7.3f} {lv['ttft_p50_ms']:>9.1f} "
              f"{lv['ttft_p99_ms']:>9.1f} {lv['itl_p50_ms']:>8.2f} {lv['itl_p99_ms']:>8.2f} "
              f"{lv['latency_p50_s']:>9.3f} {counts:>10}")
    print(f"(ms unless noted; ITL per request, averaged over its {output_tokens - 1} gaps; tokens/req: the distinct "
          "completion_tokens the server reported)")


def chart(levels: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv["concurrency"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(xs, [lv["output_tokens_per_s"] for lv in levels], "o-")
    a.set_xlabel("concurrent streams (guidellm)")
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
                       ("itl_p99_ms", "ITL p99")):
        ys = [lv[key] for lv in levels]
        if any(y > 0 and math.isfinite(y) for y in ys):
            b.plot(xs, ys, "o-", label=label)
    b.set_xlabel("concurrent streams (guidellm)")
    b.set_ylabel("ms")
    b.set_yscale("log")
    b.legend()
    b.set_title("latency")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def engine_info(engine: Path) -> dict[str, Any]:
    m = json.loads((engine / "manifest.json").read_text())
    src = m.get("source") or {}
    return {"path": str(engine), "source": src.get("model") or src.get("path"),
            **{k: m.get(k) for k in ("architecture", "precision", "target", "limits")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, required=True, help="engine directory (manifest.json, tokenizer.json)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16], help="concurrent streams per level")
    ap.add_argument("--requests-per-level", type=int, default=16, help="each level stops after this many requests")
    ap.add_argument("--max-seconds", type=float, default=120, help="... or after this long")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--guidellm", default=str(Path.home() / "glvenv" / "bin" / "guidellm"),
                    help="the guidellm executable (its own virtual environment)")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="guidellm worker processes (GUIDELLM__MAX_WORKER_PROCESSES; 0: guidellm's default, up to "
                         "10): each runs its streams on asyncio, and on a small CPU every extra one takes cores from "
                         "the server (default 1)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="local tokenizer folder (default: the engine's)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra argument for trtinfer serve, repeatable: --serve-arg=--max-slots=16")
    ap.add_argument("--out", type=Path, default=None,
                    help="output path without suffix (default benchmarks/results/guidellm_<cpu-tag>_<date>)")
    args = ap.parse_args()
    engine = args.engine.expanduser().resolve()
    tokenizer = (args.tokenizer or engine).expanduser().resolve()
    if not (engine / "manifest.json").is_file():
        ap.error(f"{engine} has no manifest.json: not an engine directory")
    if not (tokenizer / "tokenizer.json").is_file() and not (tokenizer / "tokenizer_config.json").is_file():
        ap.error(f"{tokenizer} has no tokenizer.json / tokenizer_config.json (guidellm must not fetch one)")
    if not shutil.which(args.guidellm):
        ap.error(f"no guidellm at {args.guidellm} (pass --guidellm PATH)")
    eng = engine_info(engine)
    max_len = (eng.get("limits") or {}).get("max_seq_len")
    if max_len and args.prompt_tokens + args.output_tokens + 8 > max_len:
        ap.error(f"prompt {args.prompt_tokens} + output {args.output_tokens} tokens do not fit the engine's "
                 f"{max_len} positions")

    if args.requests_per_level < max(args.levels):
        print(f"warning: --requests-per-level {args.requests_per_level} < {max(args.levels)} streams: those levels "
              "never have all their streams busy at once", file=sys.stderr)
    machine, date = machine_info(), time.strftime("%Y-%m-%d")
    tag = cpu_kind(machine)
    out = args.out or RESULTS / f"guidellm_{tag}_{date}"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_name(out.name + ".log")
    version = guidellm_version(args.guidellm)
    tmp = Path(tempfile.mkdtemp(prefix="guidellm_serve_"))
    raw_path = tmp / "guidellm.json"
    load_before = os.getloadavg()
    proc, url, server_log = start_server(engine, args.serve_arg)
    try:
        # warm-up (first-call allocations), outside guidellm's measurement and the counters' window
        httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4},
                   timeout=300).raise_for_status()
        before = server_counters(url)
        cmd = guidellm_command(args.guidellm, url, tokenizer, raw_path, args)
        env = guidellm_env(args.client_processes or None)
        env_used = {k: v for k, v in env.items() if k in OFFLINE or k.startswith("GUIDELLM__")}
        command_line = " ".join(f"{k}={v}" for k, v in env_used.items()) + " " + shlex.join(cmd)
        print("running:", command_line, flush=True)
        t0 = time.perf_counter()
        rc = run_guidellm(cmd, log_path, len(args.levels) * (args.max_seconds + 120) + 300, env)
        wall = time.perf_counter() - t0
        after = server_counters(url)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if rc != 0 or not raw_path.is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"guidellm failed (exit {rc}); see {log_path}")
    report = json.loads(raw_path.read_text())
    levels = summarize(report, args.prompt_tokens, args.output_tokens, exact_prompt=args.api == "completions")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}
    counted = sum(lv["output_tokens"] for lv in levels)
    finished = sum(lv["requests"] for lv in levels)
    checks = {
        "all_output_tokens_exact": all(lv["all_output_tokens_exact"] for lv in levels),
        "all_prompt_tokens_exact": (all(lv["all_prompt_tokens_exact"] for lv in levels)
                                    if args.api == "completions" else None),
        "prompt_token_counts": sorted({c for lv in levels for c in lv["prompt_token_counts"]}, key=str),
        "server_generation_tokens": delta.get("generation_tokens_total", float("nan")),
        "guidellm_output_tokens": counted,
        "server_finished_length": delta.get("request_success_total:length", 0.0),
        "guidellm_completed": finished,
        "no_errors": all(lv["errors"] == 0 for lv in levels),
        "incomplete": sum(lv["incomplete"] for lv in levels),  # cut off when a level hit --max-seconds
    }
    # requests cut off (incomplete) made tokens the server counted and guidellm did not: no comparison then
    matched = checks["server_generation_tokens"] == counted and checks["server_finished_length"] == finished
    checks["server_counts_match"] = None if checks["incomplete"] else matched
    print_table(levels, args.output_tokens)
    print("checks:", ", ".join(f"{k}={v}" for k, v in checks.items()))
    for key in ("all_output_tokens_exact", "all_prompt_tokens_exact", "server_counts_match", "no_errors"):
        if checks[key] is False:
            print(f"WARNING: check {key} failed (see the levels' token counts and error_samples in the JSON)",
                  file=sys.stderr)
    if checks["incomplete"]:
        print(f"note: {checks['incomplete']} request(s) cut off by --max-seconds {args.max_seconds} (not in the "
              "latency figures)", file=sys.stderr)

    raw_gz = out.with_name(out.name + "_raw.json.gz")
    with gzip.open(raw_gz, "wt") as f:
        json.dump(report, f)
    shutil.rmtree(tmp, ignore_errors=True)
    # the server is ``python -m trtinfer.cli`` started here: the working directory's trtinfer where it has one
    served = Path.cwd() if (Path.cwd() / "trtinfer").is_dir() else Path(__file__).resolve().parent.parent
    commit = git_commit(served)
    record = {"machine": machine, "cpu_tag": tag, "date": date, "git_commit": commit,
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "engine": eng, "server": {"serve_args": args.serve_arg, "log_head": server_log[:3]},
              "guidellm": {"version": version, "command": cmd, "env": env_used,
                           "command_line": command_line, "wall_s": round(wall, 1),
                           "raw_report": raw_gz.name, "log": log_path.name},
              "settings": {"api": args.api, "levels": args.levels, "requests_per_level": args.requests_per_level,
                           "max_seconds": args.max_seconds, "prompt_tokens": args.prompt_tokens,
                           "output_tokens": args.output_tokens, "tokenizer": str(tokenizer)},
              "command": [sys.executable, *sys.argv], "levels": levels, "checks": checks}
    json_path, png_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".png")
    json_path.write_text(json.dumps(record, indent=1))
    chart(levels, f"guidellm {version} -> trtinfer serve {engine.name} ({eng.get('precision')}, {tag}), "
                  f"{args.prompt_tokens} in / {args.output_tokens} out", png_path)
    print(f"wrote {json_path}, {png_path}, {raw_gz}")


if __name__ == "__main__":
    main()
