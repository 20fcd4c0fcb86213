"""Side-by-side benchmark: an engine and PyTorch eager on the same model, prompt and batch, in one run.

Each system runs in its own subprocess, so its peak memory (max RSS, load included) is its own.
Decode tokens/s counts every sequence of the batch (tokens after the first / decode time), best of 3 runs; TTFT is
the wall time of a one-token ``generate`` call, best of 5 (this 2-core machine is shared: best-of is what repeats).
Every system decodes greedily, whatever the model's ``generation_config.json`` says.

On a GPU (an engine loaded with ``provider="cuda"``/``"tensorrt"`` or built with ``--backend tensorrt``; eager with
``device="cuda"``) each result also carries ``gpu``: the GPU memory the process held and how that was measured
(:class:`GpuMemory`), and for eager ``torch.cuda.max_memory_allocated``. Eager timings synchronize the device.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trtinfer.errors import InputError, TrtInferError
from trtinfer.runtime.memory import peak_rss_mib, proc_kib

log = logging.getLogger(__name__)

PROMPT_TEXT = ("The history of the city of Paris begins in antiquity, when a Celtic tribe settled on an island in "
               "the Seine. ") * 40

#: eager dtype name (the engines' precision names) -> torch dtype attribute
EAGER_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_SAID = 3  # the worker's exit code for an error it reports on stdout as JSON
ENGINE_PROVIDERS = ("cpu", "cuda", "tensorrt")  # RuntimeConfig's providers (not imported: keeps this module light)


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
    gpu: dict[str, Any] | None = None  # GPU runs only: device, memory figures and how each was measured
    load_s: float | None = None  # engines: seconds to load (trtinfer.load)
    #: CPU engines: the process's private anonymous memory after the runs (the packed weights live there), resident
    #: and of it on 2 MiB pages (``RuntimeConfig.huge_pages``: whether the collapse took, which moves decode 3-18%)
    anon_rss_mib: float | None = None
    anon_huge_mib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON; figures a run has not (None) are left out: CPU results' ``gpu`` as they always have
        been, eager ones' ``load_s`` and anonymous memory."""
        optional = ("gpu", "load_s", "anon_rss_mib", "anon_huge_mib")
        return {k: v for k, v in asdict(self).items() if v is not None or k not in optional}


def _prompt_ids(engine_dir: Path, prompt_len: int) -> list[int]:
    from trtinfer.artifact import read_manifest
    from trtinfer.runtime.tokenizer import EngineTokenizer

    tok = EngineTokenizer(engine_dir, read_manifest(engine_dir).tokenizer_info)
    ids = tok.encode(PROMPT_TEXT)
    if len(ids) < prompt_len:
        raise InputError(f"prompt length {prompt_len} exceeds the {len(ids)}-token benchmark text; use at most "
                         f"{len(ids)}")
    return ids[:prompt_len]


def nvidia_smi(*args: str) -> list[str] | None:
    """nvidia-smi's non-empty output lines, or None when it is missing or fails."""
    try:
        out = subprocess.run(["nvidia-smi", *args], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def smi_device(device_id: int) -> str:
    """nvidia-smi's ``-i`` for CUDA device ``device_id``: nvidia-smi ignores CUDA_VISIBLE_DEVICES, so map through it
    (its entries are indices or UUIDs, both of which ``-i`` takes)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[device_id] if device_id < len(visible) else str(device_id)


def _to_mib(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]" where the driver does not account per process
        return None


class GpuMemory:
    """GPU memory held by this process, the cheapest way the machine allows; ``method`` of the result says which.

    1. ``nvidia-smi --query-compute-apps``: this process's own ``used_memory`` (CUDA context included), read after
       the runs. Allocators keep what they grew to (ONNX Runtime's arena, torch's caching allocator), so this is close
       to the peak, but it is the current figure, not a recorded peak.
    2. Where the driver lists no process of ours (a container's own PID namespace): ``nvidia-smi --query-gpu
       memory.used`` of the whole device, after the runs minus before the load (other processes' use counts).
    3. Without nvidia-smi: ``cudaMemGetInfo`` (cuda-python) of the whole device, after minus before; the first call
       creates the CUDA context, so the context is not in the figure.
    Create the probe before the model is loaded; :meth:`result` after the runs.
    """

    def __init__(self, device_id: int = 0) -> None:
        self.device = smi_device(device_id)
        self.device_id = device_id
        self.smi_before: float | None = None
        self.cudart_before: float | None = None
        lines = nvidia_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", self.device)
        if lines:
            self.smi_before = _to_mib(lines[0])
        else:
            self.cudart_before = self._cudart_used()

    def _cudart_used(self) -> float | None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            return None
        rt.cudaSetDevice(self.device_id)
        err, free, total = rt.cudaMemGetInfo()
        return (total - free) / 2**20 if err == rt.cudaError_t.cudaSuccess else None

    def result(self) -> dict[str, Any]:
        """``{"used_mib": float | None, "method": str | None}``."""
        own = nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
        for line in own or []:
            pid, _, used = line.partition(",")
            mib = _to_mib(used.strip())
            if pid.strip() == str(os.getpid()) and mib is not None:
                return {"used_mib": mib, "method": "nvidia-smi --query-compute-apps used_memory of this process, "
                                                  "after the runs"}
        if self.smi_before is not None:
            lines = nvidia_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", self.device)
            after = _to_mib(lines[0]) if lines else None
            if after is not None:
                return {"used_mib": after - self.smi_before,
                        "method": "nvidia-smi --query-gpu memory.used of the device, after the runs minus before the "
                                  "load (other processes count)"}
        if self.cudart_before is not None:
            after = self._cudart_used()
            if after is not None:
                return {"used_mib": after - self.cudart_before,
                        "method": "cudaMemGetInfo of the device, after the runs minus before the load (CUDA context "
                                  "excluded; other processes count)"}
        return {"used_mib": None, "method": None}


def run_engine(engine_dir: Path, bs: int, prompt_len: int, new_tokens: int, repeats: int = 5,
               provider: str | None = None, huge_pages: bool = True) -> BenchResult:
    """Measure an engine in this process; ``provider`` None loads with the engine's defaults (``RuntimeConfig``);
    ``huge_pages`` False: its packed weights stay on 4 KiB pages (``RuntimeConfig.huge_pages``)."""
    import trtinfer
    from trtinfer.artifact import read_manifest

    ids = [_prompt_ids(engine_dir, prompt_len)] * bs
    on_gpu = provider in ("cuda", "tensorrt") or read_manifest(engine_dir).backend == "tensorrt"
    probe = GpuMemory() if on_gpu else None
    t_load = time.perf_counter()
    options: dict[str, Any] = {"huge_pages": huge_pages, **({"provider": provider} if provider else {})}
    # greedy, as eager (below) and the peers decode: a model's generation_config.json may sample (Llama-3.2's and
    # Qwen3's do: top-p over the vocabulary every step, 12% of a 1B int4 engine's batch-8 decode step)
    with trtinfer.load(engine_dir, **options) as eng:
        load_s = time.perf_counter() - t_load
        eng.generate(input_ids=ids, max_new_tokens=4, ignore_eos=True, do_sample=False)  # warm-up
        def first_token_ms() -> float:  # the whole call, as for eager: prefill, selection, bookkeeping
            t0 = time.perf_counter()
            eng.generate(input_ids=ids, max_new_tokens=1, do_sample=False)
            return (time.perf_counter() - t0) * 1000.0

        ttft = min(first_token_ms() for _ in range(repeats))
        rates, first = [], []
        for _ in range(3):
            r = eng.generate(input_ids=ids, max_new_tokens=new_tokens, ignore_eos=True, do_sample=False)
            t = r[0].timings
            rates.append(bs * len(t.decode_ms) / (sum(t.decode_ms) / 1000.0))
            first = r[0].token_ids[:8]
        gpu = None if probe is None else {"provider": provider, **probe.result()}
        anon, huge_kib = (None, None) if on_gpu else (proc_kib("/proc/self/smaps_rollup", "Anonymous"),
                                                      proc_kib("/proc/self/smaps_rollup", "AnonHugePages"))
    system = "trtinfer " + engine_dir.name + (f" ({provider})" if provider else "")
    rss, huge = (None, None) if anon is None or huge_kib is None else (anon / 1024, huge_kib / 1024)
    return BenchResult(system, bs, prompt_len, new_tokens, ttft, max(rates), peak_rss_mib(), first, gpu, load_s,
                       rss, huge)


def run_eager(engine_dir: Path, bs: int, prompt_len: int, new_tokens: int, repeats: int = 5, device: str = "cpu",
              dtype: str = "fp32") -> BenchResult:
    """Measure transformers' ``generate`` on the engine's source model in this process, on ``device`` in ``dtype``
    (a key of :data:`EAGER_DTYPES`)."""
    probe = GpuMemory(torch_device_index(device)) if device.startswith("cuda") else None  # before torch's context
    import torch
    from transformers import AutoModelForCausalLM

    from trtinfer.artifact import read_manifest
    from trtinfer.checkpoint import GGUF_LINK

    src = Path(read_manifest(engine_dir).source["path"])
    if not (src / "config.json").is_file():
        raise InputError(f"the eager baseline needs the engine's source model at {src}; rebuild the engine here")
    dev = torch.device(device)
    ids = torch.tensor([_prompt_ids(engine_dir, prompt_len)] * bs, device=dev)
    mask = torch.ones_like(ids)
    if (src / GGUF_LINK).exists():  # a large GGUF's folder: its weights are read (dequantized) from the GGUF
        from trtinfer.export.onnx_export import load_hf_model

        model: Any = load_hf_model(src).to(getattr(torch, EAGER_DTYPES[dtype]))
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, EAGER_DTYPES[dtype]))
    model = model.to(dev).eval()  # Any: transformers types .to() as a wrapped method mypy cannot match a device to
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def gen(n: int) -> tuple[float, Any]:
        with torch.inference_mode():
            sync()  # nothing queued before the clock starts, everything done before it stops
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            sync()
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
    gpu = None
    if probe is not None:
        gpu = {"device": str(dev), "dtype": dtype, **probe.result(),
               "torch_max_memory_allocated_mib": torch.cuda.max_memory_allocated(dev) / 2**20}
    system = "pytorch eager" if (device, dtype) == ("cpu", "fp32") else f"pytorch eager {dtype} ({device})"
    return BenchResult(system, bs, prompt_len, new_tokens, ttft * 1000, dec, peak_rss_mib(),
                       out[0, prompt_len:prompt_len + 8].tolist(), gpu)


def torch_device_index(device: str) -> int:
    """``"cuda:1"`` -> 1, ``"cuda"`` -> 0 (torch's current device is 0 in a fresh process)."""
    _, _, index = device.partition(":")
    return int(index) if index.isdigit() else 0


def _check_eager(device: str, dtype: str) -> None:
    if dtype not in EAGER_DTYPES:
        raise InputError(f"eager dtype must be one of {sorted(EAGER_DTYPES)}, got {dtype!r}")
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise InputError(f"eager device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _check_provider(provider: str | None) -> None:
    if provider is not None and provider not in ENGINE_PROVIDERS:
        raise InputError(f"provider must be one of {ENGINE_PROVIDERS} or None, got {provider!r}")


def _in_subprocess(kind: str, engine_dir: Path, bs: int, prompt_len: int, new_tokens: int,
                   flags: Sequence[str] = ()) -> BenchResult:
    cmd = [sys.executable, "-m", "trtinfer.bench", kind, str(engine_dir), str(bs), str(prompt_len), str(new_tokens),
           *flags]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    said = json.loads((proc.stdout.strip().splitlines() or ["{}"])[-1]) if proc.returncode in (0, _SAID) else {}
    if proc.returncode == _SAID:  # the worker's own one-line error, raised again here as what it was
        import trtinfer.errors

        cls = getattr(trtinfer.errors, said.get("error_type", ""), TrtInferError)
        raise (cls if isinstance(cls, type) and issubclass(cls, TrtInferError) else TrtInferError)(said["error"])
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise TrtInferError(f"the {kind} benchmark's process failed (exit {proc.returncode}): {last}")
    return BenchResult(**said)


def _check_sizes(batch_size: int, prompt_len: int, new_tokens: int) -> None:
    for what, value, low in (("batch_size", batch_size, 1), ("prompt_len", prompt_len, 1),
                             ("new_tokens", new_tokens, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            flag = "--" + what.replace("_", "-")
            raise InputError(f"{what} ({flag}) must be an integer >= {low}, got {value!r}")


def check_engine(engine_dir: str | Path, batch_size: int, prompt_len: int, new_tokens: int, *,
                 limits: bool = True) -> None:
    """Raise a one-line error now, before any process starts, when ``engine_dir`` is not a decoder engine or the
    sizes do not fit it (the benchmark text's length; with ``limits``, its batch and sequence limits)."""
    from trtinfer.artifact import read_manifest
    from trtinfer.errors import EngineLoadError

    _check_sizes(batch_size, prompt_len, new_tokens)
    manifest = read_manifest(Path(engine_dir))
    if manifest.kind != "decoder":
        raise EngineLoadError(f"{engine_dir} is an {manifest.kind} engine; the benchmark times decoders (generation)")
    if limits and batch_size > manifest.max_batch_size:
        raise InputError(f"batch size {batch_size} exceeds the engine's maximum {manifest.max_batch_size}; bench at "
                         f"most {manifest.max_batch_size} or rebuild with --max-batch-size {batch_size}")
    if limits and prompt_len + new_tokens > manifest.max_seq_len:
        raise InputError(f"prompt length {prompt_len} + new tokens {new_tokens} exceed the engine's "
                         f"{manifest.max_seq_len} positions; ask for fewer or rebuild with a larger --max-seq-len")
    _prompt_ids(Path(engine_dir), prompt_len)  # the benchmark text is long enough


def measure_engine(engine_dir: str | Path, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 64,
                   provider: str | None = None, huge_pages: bool = True) -> BenchResult:
    """:func:`run_engine` in its own process (its memory figures are its own)."""
    _check_provider(provider)
    check_engine(engine_dir, batch_size, prompt_len, new_tokens)
    return _engine_process(engine_dir, batch_size, prompt_len, new_tokens, provider, huge_pages)


def _engine_process(engine_dir: str | Path, batch_size: int, prompt_len: int, new_tokens: int,
                    provider: str | None, huge_pages: bool = True) -> BenchResult:
    flags = (["--provider", provider] if provider else []) + ([] if huge_pages else ["--no-huge-pages"])
    return _in_subprocess("engine", Path(engine_dir), batch_size, prompt_len, new_tokens, flags)


def measure_eager(engine_dir: str | Path, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 64,
                  device: str = "cpu", dtype: str = "fp32") -> BenchResult:
    """:func:`run_eager` in its own process."""
    _check_eager(device, dtype)  # the settings first, then the engine
    check_engine(engine_dir, batch_size, prompt_len, new_tokens, limits=False)  # eager: the engine's limits aside
    return _eager_process(engine_dir, batch_size, prompt_len, new_tokens, device, dtype)


def _eager_process(engine_dir: str | Path, batch_size: int, prompt_len: int, new_tokens: int, device: str,
                   dtype: str) -> BenchResult:
    flags = [] if (device, dtype) == ("cpu", "fp32") else ["--device", device, "--dtype", dtype]
    return _in_subprocess("eager", Path(engine_dir), batch_size, prompt_len, new_tokens, flags)


def ratios(engine: dict[str, Any], eager: dict[str, Any]) -> dict[str, Any]:
    """Engine figures over eager's (two result dicts): decode (higher is better), TTFT and peak RSS (lower is)."""
    return {"decode": round(engine["decode_tok_s"] / eager["decode_tok_s"], 3),
            "ttft": round(engine["ttft_ms"] / eager["ttft_ms"], 3),
            "peak_rss": round(engine["peak_rss_mib"] / eager["peak_rss_mib"], 3),
            "same_first_tokens": engine["first_tokens"] == eager["first_tokens"]}


def compare(engine_dir: str | Path, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 64,
            eager: bool = True, *, provider: str | None = None, eager_device: str = "cpu",
            eager_dtype: str = "fp32") -> dict[str, Any]:
    """Run the engine (and eager) side by side; returns figures and ratios vs eager.

    ``provider`` loads the engine on that execution provider (None: the engine's default, the CPU);
    ``eager_device``/``eager_dtype`` place PyTorch eager (``"cuda"``, ``"fp16"``: the same GPU, half precision).
    """
    _check_provider(provider)  # every setting before the engine, and all of it before the engine's run
    if eager:
        _check_eager(eager_device, eager_dtype)
    check_engine(engine_dir, batch_size, prompt_len, new_tokens)  # once, for both runs (eager's limits are wider)
    rows = [_engine_process(engine_dir, batch_size, prompt_len, new_tokens, provider)]
    if eager:
        rows.append(_eager_process(engine_dir, batch_size, prompt_len, new_tokens, eager_device, eager_dtype))
    out: dict[str, Any] = {"engine": str(Path(engine_dir)), "results": [r.to_dict() for r in rows]}
    if eager:
        out["ratios_vs_eager"] = ratios(out["results"][0], out["results"][1])
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


def _worker(argv: Sequence[str]) -> BenchResult:
    """``engine|eager DIR BS PROMPT_LEN NEW_TOKENS [--provider P] [--device D --dtype T]``: one measurement."""
    ap = argparse.ArgumentParser(prog="python -m trtinfer.bench")
    ap.add_argument("kind", choices=("engine", "eager"))
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("batch_size", type=int)
    ap.add_argument("prompt_len", type=int)
    ap.add_argument("new_tokens", type=int)
    ap.add_argument("--provider", choices=ENGINE_PROVIDERS, default=None, help="engine: execution provider")
    ap.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                    help="engine: leave the packed weights on 4 KiB pages")
    ap.add_argument("--device", default="cpu", help="eager: cpu, cuda or cuda:N")
    ap.add_argument("--dtype", choices=sorted(EAGER_DTYPES), default="fp32", help="eager: weights and compute dtype")
    a = ap.parse_args(argv)
    if a.kind == "engine":
        return run_engine(a.engine_dir, a.batch_size, a.prompt_len, a.new_tokens, provider=a.provider,
                          huge_pages=a.huge_pages)
    _check_eager(a.device, a.dtype)
    return run_eager(a.engine_dir, a.batch_size, a.prompt_len, a.new_tokens, device=a.device, dtype=a.dtype)


if __name__ == "__main__":  # worker: python -m trtinfer.bench engine|eager DIR BS PROMPT_LEN NEW_TOKENS [flags]
    try:
        print(json.dumps(_worker(sys.argv[1:]).to_dict()))
    except TrtInferError as e:  # said to the parent as data: it raises it again, one line
        print(json.dumps({"error": str(e), "error_type": type(e).__name__}))
        sys.exit(_SAID)
