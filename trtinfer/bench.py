"""Side-by-side benchmark: an engine and PyTorch eager on the same model, prompt and batch, in one run.

Each system runs in its own subprocess, so its peak memory (max RSS, load included) is its own.
Decode tokens/s counts every sequence of the batch (tokens after the first / decode time), best of 3 runs; TTFT is
the wall time of a one-token ``generate`` call, best of 5 (this 2-core machine is shared: best-of is what repeats).
"""
from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtinfer.errors import InputError, TrtInferError

log = logging.getLogger(__name__)

PROMPT_TEXT = ("The history of the city of Paris begins in antiquity, when a Celtic tribe settled on an island in "
               "the Seine. ") * 40


@dataclass(frozen=True)
class BenchResult:
    """One system's figures."""

    system: str
    batch_size: int
    prompt_len: int
    new_tokens: int
    ttft_ms: float
    decode_tok_s: float
    peak_rss_mib: float
    first_tokens: list[int]


def _prompt_ids(engine_dir: Path, prompt_len: int) -> list[int]:
    from trtinfer.runtime.manifest import read_manifest
    from trtinfer.runtime.tokenizer import EngineTokenizer

    tok = EngineTokenizer(engine_dir, read_manifest(engine_dir).raw.get("tokenizer", {}))
    ids = tok.encode(PROMPT_TEXT)
    if len(ids) < prompt_len:
        raise InputError(f"prompt_len {prompt_len} exceeds the {len(ids)}-token benchmark text")
    return ids[:prompt_len]


def _peak_mib() -> float:
    """This process's peak RSS. VmHWM belongs to the process image; ru_maxrss would carry over the parent's peak
    across fork+exec and report the driver's memory instead of the worker's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_engine(engine_dir: Path, bs: int, prompt_len: int, new_tokens: int, repeats: int = 5) -> BenchResult:
    """Measure an engine in this process."""
    import trtinfer

    ids = [_prompt_ids(engine_dir, prompt_len)] * bs
    with trtinfer.load(engine_dir) as eng:
        eng.generate(input_ids=ids, max_new_tokens=4, ignore_eos=True)  # warm-up
        def first_token_ms() -> float:  # the whole call, as for eager: prefill, sampling, bookkeeping
            t0 = time.perf_counter()
            eng.generate(input_ids=ids, max_new_tokens=1)
            return (time.perf_counter() - t0) * 1000.0

        ttft = min(first_token_ms() for _ in range(repeats))
        rates, first = [], []
        for _ in range(3):
            r = eng.generate(input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True)
            t = r[0].timings
            rates.append(bs * len(t.decode_ms) / (sum(t.decode_ms) / 1000.0))
            first = r[0].token_ids[:8]
    return BenchResult("trtinfer " + engine_dir.name, bs, prompt_len, new_tokens, ttft, max(rates), _peak_mib(),
                       first)


def run_eager(engine_dir: Path, bs: int, prompt_len: int, new_tokens: int, repeats: int = 5) -> BenchResult:
    """Measure transformers' ``generate`` on the engine's source model in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    from trtinfer.runtime.manifest import read_manifest

    src = Path(read_manifest(engine_dir).raw["source"]["path"])
    if not (src / "config.json").is_file():
        raise InputError(f"the eager baseline needs the engine's source model at {src}; rebuild the engine here")
    ids = torch.tensor([_prompt_ids(engine_dir, prompt_len)] * bs)
    mask = torch.ones_like(ids)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()

    def gen(n: int) -> tuple[float, Any]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0, out

    gen(4)
    firsts = [gen(1)[0] for _ in range(repeats)]
    ttft = min(firsts)  # reported (best of, as for the engine)
    totals, out = [], None
    for _ in range(3):
        total, out = gen(new_tokens)
        totals.append(total)
    # decode time = whole generate minus its prefill; the median prefill, so the min above does not tilt it
    dec = bs * (new_tokens - 1) / (min(totals) - statistics.median(firsts))
    assert out is not None
    return BenchResult("pytorch eager", bs, prompt_len, new_tokens, ttft * 1000, dec, _peak_mib(),
                       out[0, prompt_len:prompt_len + 8].tolist())


def _in_subprocess(kind: str, engine_dir: Path, bs: int, prompt_len: int, new_tokens: int) -> BenchResult:
    cmd = [sys.executable, "-m", "trtinfer.bench", kind, str(engine_dir), str(bs), str(prompt_len), str(new_tokens)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TrtInferError(f"{kind} benchmark failed: {last}")
    return BenchResult(**json.loads(proc.stdout.strip().splitlines()[-1]))


def compare(engine_dir: str | Path, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 64,
            eager: bool = True) -> dict[str, Any]:
    """Run the engine (and eager) side by side; returns figures and ratios vs eager."""
    engine_dir = Path(engine_dir)
    if batch_size < 1 or prompt_len < 1 or new_tokens < 2:
        raise InputError("batch_size and prompt_len must be >= 1 and new_tokens >= 2")
    rows = [_in_subprocess("engine", engine_dir, batch_size, prompt_len, new_tokens)]
    if eager:
        rows.append(_in_subprocess("eager", engine_dir, batch_size, prompt_len, new_tokens))
    out: dict[str, Any] = {"engine": str(engine_dir), "results": [asdict(r) for r in rows]}
    if eager:
        e, b = rows[1], rows[0]
        out["ratios_vs_eager"] = {"decode": round(b.decode_tok_s / e.decode_tok_s, 3),
                                  "ttft": round(b.ttft_ms / e.ttft_ms, 3),
                                  "peak_rss": round(b.peak_rss_mib / e.peak_rss_mib, 3),
                                  "same_first_tokens": b.first_tokens == e.first_tokens}
    return out


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of a :func:`compare` report."""
    lines = [f"{'system':<34} {'bs':>3} {'TTFT ms':>9} {'decode tok/s':>13} {'peak MiB':>9}  first tokens"]
    for r in report["results"]:
        lines.append(f"{r['system']:<34} {r['batch_size']:>3} {r['ttft_ms']:>9.1f} {r['decode_tok_s']:>13.1f} "
                     f"{r['peak_rss_mib']:>9.0f}  {r['first_tokens']}")
    if "ratios_vs_eager" in report:
        q = report["ratios_vs_eager"]
        lines.append(f"vs eager: decode x{q['decode']:.2f}, TTFT x{q['ttft']:.2f}, peak memory x{q['peak_rss']:.2f}, "
                     f"same first tokens: {q['same_first_tokens']}")
    return "\n".join(lines)


if __name__ == "__main__":  # worker: python -m trtinfer.bench engine|eager DIR BS PROMPT_LEN NEW_TOKENS
    kind, d, bs_, pl_, nt_ = sys.argv[1:6]
    fn = run_engine if kind == "engine" else run_eager
    res = fn(Path(d), int(bs_), int(pl_), int(nt_))
    print(json.dumps(asdict(res)))
