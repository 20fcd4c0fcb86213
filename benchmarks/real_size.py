"""Engines at real model shapes, built and run through the public CLI: what a build costs (wall time, peak memory,
cache and engine bytes), what its checks said, what the engine costs to load and run, and how close its decode
steps get to the machine's measured memory bandwidth.

usage: python -m benchmarks.real_size (--checkpoint DIR | --preset NAME [--layers N] [--vocab V] | --gguf FILE)
           [--precisions fp32,int8,int4[+b128][+prefill]] [--method M] [--cache DIR] [--work DIR] [--batch-sizes 1,8]
           [--prompt-len 512] [--batch-prompt-len 32] [--new-tokens 32] [--buffer-mib 1024] [--oga-python PY]
           [--llama-cpp-python PY --llama-cpp-convert SCRIPT [--llama-cpp-types Q4_0,Q4_K_M] [--llama-cpp-outtype q8_0]]
           [--keep] [--out PREFIX]

1. Checkpoint: ``--checkpoint DIR`` (a Hugging Face folder), or ``--preset`` (``make_checkpoint.py``'s presets and
   slices), written once to ``WORK/checkpoints/<preset>[-lN][-vV]`` and reused by later runs.
2. Build, per precision: ``python -m trtinfer build CKPT --precision P -o ENGINE --force`` (int4: ``--method rtn``
   unless ``--method``) under ``/usr/bin/time -v``: its peak RSS (the largest single process; GNU time reports
   ``ru_maxrss`` of the child) and wall time, exit code, ``TRTINFER_CACHE`` growth and engine size (allocated
   bytes, as ``du`` counts them), and the manifest's ``export.validation``, ``engine_check`` and ``accuracy_check``
   (where they did not run, the manifest's reasons: ``export.validation_skipped``, ``export.reference_skipped``,
   ``quantization.accuracy.skipped``). A failed build is a row, with
   the last line the CLI wrote to stderr as its error; its log stays in the run folder with ``--keep``.
3. Run, per engine and batch size: ``roofline.measure_decode`` (``trtinfer.bench.measure_engine``: ``trtinfer.load``
   in its own process, greedy, best of 3 decode rates; peak RSS = that process's VmHWM after load and every
   generate; TTFT = best of 5 one-token generates) and ``roofline.roofline_row``: bytes one decode step reads / step
   time / the ``read`` bandwidth probed (``roofline.probe_bandwidth``) before and after all engines, the best of
   the two. Batch 1 runs with the ``--prompt-len`` prompt (512 tokens: its TTFT is the 512-token TTFT), larger
   batches with ``--batch-prompt-len`` (each run prefills 9 times; a long prompt at batch 8 costs minutes at 8B).

4. Peers on the same checkpoint in the same run: onnxruntime-genai's builder (``-p int4 -e cpu``) and llama.cpp: the
   checkpoint converted to a bf16 GGUF (``--llama-cpp-outtype q8_0``: a Q8_0 one, quantized again, where the disk
   has no room for a second bf16 copy) by llama.cpp's own ``convert_hf_to_gguf.py`` (``peer_workers/convert_llama_cpp.py``
   names our tokenizer's pre-tokenizer), quantized by ``llama_model_quantize`` (``peer_workers/quantize_llama_cpp.py``)
   to each ``--llama-cpp-types``; build wall time = conversion + quantization, build peak = the larger of the two.
   llama-cpp-python generates one sequence at a time: its larger batches are rows with that error. Its roofline
   fraction counts the quantized file's tensor bytes as one decode step's reads (every weight once; KV not counted).
   With ``--gguf FILE`` (a GGUF as the source: ours built from it, e.g. ``--precisions gguf``), llama.cpp runs that
   very file (one row, no conversion); the prompt's ids come from the first engine's tokenizer (the GGUF's
   vocabulary as trtinfer converted it).

Each engine is deleted once measured, the default cache once the builds are done, and the run folder (engines, logs)
at the end, unless ``--keep``; ``--cache DIR`` is never deleted. Prints one table, writes PREFIX.json (raw figures, CPU flags,
versions, command lines) and PREFIX.png; PREFIX defaults to benchmarks/results/real_size_<checkpoint>_<machine kind>_<date>.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
from benchmarks import roofline
from benchmarks.machine import ROOT, cpu_kind, machine_info, result_path
from trtinfer.errors import TrtInferError

log = logging.getLogger("real_size")
VERSIONED = ("trtinfer", "onnxruntime", "onnx", "numpy", "tokenizers", "torch", "transformers")
TIME_START = re.compile(r"^(\tCommand being timed:|Command exited with non-zero status|Command terminated by signal)")


def tree_bytes(root: Path, exclude: Path | None = None) -> int:
    """Bytes allocated to the files under ``root`` (or to the file ``root``) as ``du`` counts them (blocks, hard
    links once); 0 if absent. Files that are ``exclude``'s (a file or folder: the source a cache links to, as a
    converted GGUF's folder does) are not counted: they are no new bytes."""
    seen: set[tuple[int, int]] = set()
    if exclude is not None and exclude.exists():
        for p in [exclude] if exclude.is_file() else exclude.rglob("*"):
            st = p.stat()
            seen.add((st.st_dev, st.st_ino))
    if root.is_file():
        st = root.stat()
        return 0 if (st.st_dev, st.st_ino) in seen else st.st_blocks * 512
    total = 0
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def ensure_checkpoint(work: Path, preset: str, layers: int | None, vocab: int | None) -> tuple[Path, list[str]]:
    """The checkpoint of ``preset`` (sliced) under ``work/checkpoints``, written by make_checkpoint.py if absent."""
    name = preset + (f"-l{layers}" if layers else "") + (f"-v{vocab}" if vocab else "")
    folder = work / "checkpoints" / name
    cmd = [sys.executable, "-m", "benchmarks.make_checkpoint", preset, "-o", str(folder)]
    cmd += [*(["--layers", str(layers)] if layers else []), *(["--vocab", str(vocab)] if vocab else [])]
    if (folder / "config.json").is_file():
        log.info("reusing checkpoint %s", folder)
    else:
        log.info("writing checkpoint %s", folder)
        subprocess.run(cmd, check=True, cwd=ROOT)
    return folder, cmd


def parse_time_v(stderr: str) -> dict[str, Any]:
    """``/usr/bin/time -v``'s peak RSS and wall time, and the program's own last stderr line before its report (the
    signal, where one ended it)."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if TIME_START.match(line)), len(lines))
    own = [line.strip() for line in lines[:start] if line.strip()]
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", stderr)
    seconds = sum(float(p) * 60**i for i, p in enumerate(reversed(wall.group(1).split(":")))) if wall else None
    signal = next((line for line in lines[start:] if line.startswith("Command terminated by signal")), None)
    # a killed program's last line is whatever it was printing (a progress bar): the kill is the error
    killed = f"{signal} (SIGKILL: the system's OOM killer, if its peak is near the machine's memory)" \
        if signal and signal.endswith(" 9") else signal
    return {"peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None, "wall_s": seconds,
            "last_line": killed or (own[-1] if own else None), "signal": signal, "tail": own[-20:]}


def build_flags(precision: str) -> list[str]:
    """The extra build flags of a ``--precisions`` entry ``P[+SUFFIX...]``: ``+prefill`` the int8 prefill graph
    (``--prefill int8``), ``+bN`` weight blocks of N (``--block-size N``); raises ValueError on another suffix."""
    flags: list[str] = []
    for extra in precision.split("+")[1:]:
        if extra == "prefill":
            flags += ["--prefill", "int8"]
        elif re.fullmatch(r"b\d+", extra):
            flags += ["--block-size", extra[1:]]
        else:
            raise ValueError(f"unknown suffix '+{extra}' in '{precision}': +prefill or +bN (block size N)")
    return flags


def build_row(ckpt: Path, precision: str, method: str | None, engine: Path, cache: Path) -> dict[str, Any]:
    """Build one engine through the CLI under ``/usr/bin/time -v``; the row of figures (``error`` on failure).
    ``precision`` is P[+SUFFIX...] (:func:`build_flags`)."""
    base = precision.partition("+")[0]
    cmd = [sys.executable, "-m", "trtinfer", "build", str(ckpt), "--precision", base, "-o", str(engine), "--force"]
    if base == "int4":
        cmd += ["--method", method or "rtn"]
    cmd += build_flags(precision)
    log_path = engine.parent / f"build-{precision}.log"
    before = tree_bytes(cache, exclude=ckpt)
    log.info("building %s (log: %s)", precision, log_path)
    with log_path.open("w+") as stderr:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=stderr, text=True,
                              env={**os.environ, "TRTINFER_CACHE": str(cache)}, check=False)
        stderr.seek(0)
        timed = parse_time_v(stderr.read())
    row: dict[str, Any] = {"precision": precision, "command": cmd, "env": {"TRTINFER_CACHE": str(cache)},
                           "exit_code": proc.returncode, "build_wall_s": timed["wall_s"],
                           "build_peak_rss_bytes": timed["peak_rss_bytes"], "signal": timed["signal"],
                           "cache_growth_bytes": tree_bytes(cache, exclude=ckpt) - before, "stdout": proc.stdout.strip()}
    if proc.returncode != 0 or not (engine / "manifest.json").is_file():
        row["error"] = timed["last_line"] or f"exit code {proc.returncode}, no output"
        row["stderr_tail"] = timed["tail"]
        log.warning("build %s failed: %s", precision, row["error"])
        return row
    m = json.loads((engine / "manifest.json").read_text())
    export = m.get("export") or {}
    quantization = m.get("quantization") or {}
    row.update(engine_bytes=tree_bytes(engine), build_seconds_manifest=m.get("build_seconds"), stages=m.get("stages"),
               export_validation=export.get("validation"), engine_check=m.get("engine_check"),
               accuracy_check=m.get("accuracy_check"), prefill_check=m.get("prefill_check"), source=m.get("source"),
               validation_skipped=export.get("validation_skipped"), reference_skipped=export.get("reference_skipped"),
               quantization_report=quantization.get("report"), stage_accuracy=quantization.get("accuracy"),
               reduced_depth_check=m.get("reduced_depth_check"))
    return row


def oga_row(ckpt: Path, python: str, out: Path, batch_sizes: Sequence[int], prompt_len: int,
            batch_prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """onnxruntime-genai's model builder (``-p int4 -e cpu``, its default RTN block-32 recipe) on the checkpoint under
    ``/usr/bin/time -v``, then its runtime at each batch size with ``peer_workers/run_oga.py`` (the rule of
    ``trtinfer.bench``); a failed build or run is a row or a run with its error."""
    from tokenizers import Tokenizer

    from trtinfer.bench import PROMPT_TEXT

    cmd = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out), "-p", "int4",
           "-e", "cpu", "-c", str(out.parent / "oga-cache")]
    log_path = out.parent / "build-oga.log"
    log.info("building onnxruntime-genai int4 (log: %s)", log_path)
    with log_path.open("w+") as stderr:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=stderr, text=True,
                              check=False)
        stderr.seek(0)
        timed = parse_time_v(stderr.read())
    shutil.rmtree(out.parent / "oga-cache", ignore_errors=True)
    row: dict[str, Any] = {"precision": "onnxruntime-genai int4", "peer": True, "command": cmd,
                           "exit_code": proc.returncode, "build_wall_s": timed["wall_s"],
                           "build_peak_rss_bytes": timed["peak_rss_bytes"], "signal": timed["signal"],
                           "cache_growth_bytes": 0}
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        row["error"] = timed["last_line"] or f"exit code {proc.returncode}, no output"
        row["stderr_tail"] = timed["tail"]
        log.warning("onnxruntime-genai's build failed: %s", row["error"])
        return row
    row["engine_bytes"] = tree_bytes(out)
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(PROMPT_TEXT).ids
    row["runs"] = []
    for bs in batch_sizes:
        plen = prompt_len if bs == 1 else batch_prompt_len
        ids_file = out.parent / f"oga-ids-{plen}.json"
        ids_file.write_text(json.dumps(ids[:plen]))
        log.info("measuring onnxruntime-genai int4 at batch %d", bs)
        run = subprocess.run([python, str(HERE / "peer_workers" / "run_oga.py"), "--model", str(out), "--ids",
                              str(ids_file), "--bs", str(bs), "--new-tokens", str(new_tokens)], check=False,
                             capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if run.returncode:
            row["runs"].append({"batch_size": bs, "prompt_len": plen,
                                "error": (run.stderr.strip() or "no output").splitlines()[-1]})
            continue
        row["runs"].append({**json.loads(run.stdout.strip().splitlines()[-1]), "batch_size": bs})
    row["version"] = next((u["version"] for u in row["runs"] if "version" in u), None)
    return row


def _timed(cmd: list[str], log_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    with log_path.open("w+") as stderr:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=subprocess.PIPE, stderr=stderr, text=True,
                              check=False)
        stderr.seek(0)
        return proc, parse_time_v(stderr.read())


def llama_cpp_rows(ckpt: Path, python: str, convert: Path, out: Path, types: Sequence[str],
                   batch_sizes: Sequence[int], prompt_len: int, new_tokens: int,
                   outtype: str = "bf16") -> list[dict[str, Any]]:
    """llama.cpp's converter (a GGUF of ``outtype``: bf16, or q8_0 where the disk holds no second bf16 copy) and
    quantizer on the checkpoint, then ``peer_workers/run_llama_cpp.py`` at batch 1 with the ``prompt_len`` prompt;
    one row per quantization type (a failure is a row with its error)."""
    out.mkdir(parents=True, exist_ok=True)
    converted = out / f"model-{outtype}.gguf"
    conv_cmd = [sys.executable, str(HERE / "peer_workers" / "convert_llama_cpp.py"), str(convert), str(ckpt),
                "--outtype", outtype, "--outfile", str(converted)]
    log.info("converting the checkpoint with llama.cpp's convert_hf_to_gguf.py (log: %s)", out / "convert.log")
    conv, conv_t = _timed(conv_cmd, out / "convert.log")
    ids_file = prompt_ids(ckpt / "tokenizer.json", prompt_len, out / f"ids-{prompt_len}.json")
    rows = []
    for kind in types:
        row: dict[str, Any] = {"precision": f"llama.cpp {kind}", "peer": True, "command": [conv_cmd],
                               "cache_growth_bytes": 0, "convert": {"wall_s": conv_t["wall_s"],
                                                                    "peak_rss_bytes": conv_t["peak_rss_bytes"]}}
        rows.append(row)
        if outtype != "bf16":
            row["converted_to"] = outtype  # quantized again from this (llama_model_quantize's allow_requantize)
        if conv.returncode or not converted.is_file():
            row.update(error=f"convert_hf_to_gguf.py: {conv_t['last_line']}", build_wall_s=conv_t["wall_s"],
                       build_peak_rss_bytes=conv_t["peak_rss_bytes"], stderr_tail=conv_t["tail"])
            continue
        gguf = out / f"model-{kind}.gguf"
        q_cmd = [python, str(HERE / "peer_workers" / "quantize_llama_cpp.py"), str(converted), str(gguf), kind]
        log.info("quantizing to %s with llama_model_quantize", kind)
        quant, quant_t = _timed(q_cmd, out / f"quantize-{kind}.log")
        row["command"].append(q_cmd)
        row.update(build_wall_s=(conv_t["wall_s"] or 0) + (quant_t["wall_s"] or 0),
                   build_peak_rss_bytes=max(conv_t["peak_rss_bytes"] or 0, quant_t["peak_rss_bytes"] or 0),
                   quantize={"wall_s": quant_t["wall_s"], "peak_rss_bytes": quant_t["peak_rss_bytes"]})
        if quant.returncode or not gguf.is_file():
            row.update(error=f"llama_model_quantize: {quant_t['last_line']}", stderr_tail=quant_t["tail"])
            continue
        row["version"] = quant.stdout.strip().splitlines()[-1] if quant.stdout.strip() else None
        llama_cpp_runs(row, python, gguf, ids_file, batch_sizes, prompt_len, new_tokens)
        gguf.unlink()
    converted.unlink(missing_ok=True)
    return rows


def prompt_ids(tokenizer_json: Path, prompt_len: int, out: Path) -> Path:
    """``out``: the first ``prompt_len`` token ids of the benchmark prompt (``trtinfer.bench.PROMPT_TEXT``), JSON."""
    from tokenizers import Tokenizer

    from trtinfer.bench import PROMPT_TEXT

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(PROMPT_TEXT).ids
    out.write_text(json.dumps(ids[:prompt_len]))
    return out


def llama_cpp_runs(row: dict[str, Any], python: str, gguf: Path, ids_file: Path, batch_sizes: Sequence[int],
                   prompt_len: int, new_tokens: int) -> None:
    """Add ``engine_bytes`` and ``runs`` to ``row``: ``peer_workers/run_llama_cpp.py`` on ``gguf`` at batch 1 (its
    larger batches are rows with an error: llama-cpp-python generates one sequence at a time)."""
    row["engine_bytes"] = tree_bytes(gguf)
    row["runs"] = []
    for bs in batch_sizes:
        if bs != 1:
            row["runs"].append({"batch_size": bs, "error": "llama-cpp-python generates one sequence at a time"})
            continue
        log.info("measuring %s at batch 1 (prompt %d)", row["precision"], prompt_len)
        run = subprocess.run([python, str(HERE / "peer_workers" / "run_llama_cpp.py"), "--model", str(gguf),
                              "--ids", str(ids_file), "--bs", "1", "--new-tokens", str(new_tokens)],
                             check=False, capture_output=True, text=True)
        if run.returncode:
            row["runs"].append({"batch_size": 1, "prompt_len": prompt_len,
                                "error": (run.stderr.strip() or "no output").splitlines()[-1]})
            continue
        res = json.loads(run.stdout.strip().splitlines()[-1])
        # every weight read once per step (the file's bytes; KV not counted): a lower bound on its reads
        res["achieved_gb_s"] = row["engine_bytes"] * res["decode_tok_s"] / 1e9
        row["runs"].append({**res, "batch_size": 1})


def llama_cpp_version(python: str) -> str | None:
    run = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                         text=True, check=False)
    return run.stdout.strip() or None


def measure_row(row: dict[str, Any], engine: Path, batch_sizes: Sequence[int], prompt_len: int,
                batch_prompt_len: int, new_tokens: int, ceiling: dict[str, float]) -> None:
    """Add ``runs`` to ``row``: one roofline row per batch size (``error`` where the measurement failed)."""
    row["runs"] = []
    for bs in batch_sizes:
        plen = prompt_len if bs == 1 else batch_prompt_len
        log.info("measuring %s at batch %d (prompt %d, %d new tokens)", row["precision"], bs, plen, new_tokens)
        try:
            res = roofline.measure_decode(engine, bs, plen, new_tokens)
        except TrtInferError as e:
            log.warning("%s batch %d: %s", row["precision"], bs, e)
            row["runs"].append({"batch_size": bs, "prompt_len": plen, "error": str(e)})
            continue
        run = roofline.roofline_row(engine, bs, plen, new_tokens, res, ceiling)
        run.update(prompt_len=plen, ttft_ms=res.ttft_ms, peak_rss_mib=res.peak_rss_mib,
                   anon_rss_mib=res.anon_rss_mib, anon_huge_mib=res.anon_huge_mib,
                   command=[sys.executable, "-m", "trtinfer.bench", "engine", str(engine), str(bs), str(plen),
                            str(new_tokens)])  # what measure_engine runs
        row["runs"].append(run)


def check_text(row: dict[str, Any]) -> str:
    """The build's checks in a few words: eager validation, engine check, held-out accuracy."""
    if "error" in row:
        return f"build failed: {row['error'][:80]}"
    if row.get("peer"):
        return "peer (its own checks)"
    v, c, a = row["export_validation"], row["engine_check"], row["accuracy_check"]
    parts = ["eager " + ("ok" if v and v.get("passed") else "FAIL" if v else
                         "skipped" if row["validation_skipped"] else "-")]
    if c:
        parts.append(f"engine {'ok' if c.get('passed') else 'FAIL'} top1 {c['top1_agreement']:.0%}")
    elif row.get("reference_skipped"):
        parts.append("engine check skipped")
    if a:
        parts.append(f"ppl x{a['ratio']:.3f} {'ok' if a.get('passed') else 'FAIL'}")
    if r := row.get("reduced_depth_check"):  # the whole model did not fit: its first layers, built (a failure fails it)
        parts.append(f"reduced {r.get('layers')}-layer model ok")
    return "; ".join(parts)


def _gib(b: float | None, unit: float = 2**30) -> str:
    return "-" if b is None else f"{b / unit:.2f}"


def format_table(report: dict[str, Any]) -> str:
    """One markdown row per precision: build costs, engine costs, decode rates, roofline fraction, checks."""
    bss = report["settings"]["batch_sizes"]
    head = (["precision", "build wall s", "build peak GiB", "cache growth GB", "engine GB", f"load+generate peak GiB (bs{bss[0]})"]
            + [f"bs{b} tok/s" for b in bss] + [f"TTFT {report['settings']['prompt_len']} ms",
                                                "% of roofline (" + "/".join(f"bs{b}" for b in bss) + ")", "checks"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        runs = {u["batch_size"]: u for u in r.get("runs", [])}
        ok = [runs.get(b, {}) for b in bss]
        wall = "-" if r["build_wall_s"] is None else f"{r['build_wall_s']:.1f}"
        peak = ok[0].get("peak_rss_mib")
        cells = [r["precision"], wall, _gib(r["build_peak_rss_bytes"]), _gib(r["cache_growth_bytes"], 1e9),
                 _gib(r.get("engine_bytes"), 1e9), _gib(peak * 2**20 if peak else None)]
        cells += [f"{u['decode_tok_s']:.1f}" if "decode_tok_s" in u else "error" if u else "-" for u in ok]
        cells.append(f"{ok[0]['ttft_ms']:.0f}" if "ttft_ms" in ok[0] else "-")
        cells.append("/".join(f"{u['fraction_of_read']:.0%}" if "fraction_of_read" in u else "-" for u in ok))
        cells.append(check_text(r))
        lines.append("| " + " | ".join(cells) + " |")
    c = report["ceiling_gb_s"]
    lines.append(f"\nroofline: bytes read per decode step / step time / the probed read bandwidth ({c['read']:.1f} "
                 f"GB/s, best of before/after; copy {c['copy']:.1f} GB/s) on {report['machine']['cpu']}")
    if "int4" in c:
        ours = [f"{r['precision']} bs{u['batch_size']} {u['fraction_of_int4_kernel']:.0%}" for r in report["rows"]
                for u in r.get("runs", []) if "fraction_of_int4_kernel" in u]
        plain = f" ({c['int4_4k']:.1f} on 4 KiB pages)" if "int4_4k" in c else ""
        lines.append(f"int4 kernel ceiling (MatMulNBits at batch 1 over packed weights on huge pages, best of "
                     f"before/after): {c['int4']:.1f} GB/s{plain}, {c['int4'] / c['read']:.0%} of the read probe; of it: "
                     + (", ".join(ours) or "no int4 rows"))
    held = [f"{r['precision']} bs{u['batch_size']} {u['fraction_of_read_held']:.0%}" for r in report["rows"]
            for u in r.get("runs", []) if "fraction_of_read_held" in u and u.get("bytes_per_step_held")
            != u.get("bytes_per_step")]
    if held:
        lines.append("counted in the bytes ONNX Runtime's int8-compute kernels hold and read (+ a float per block and "
                     "column), of the read probe: " + ", ".join(held))
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    """Left: build peak RSS, load+generate peak RSS and engine size per precision; right: roofline fractions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, bss = report["rows"], report["settings"]["batch_sizes"]
    names = [r["precision"].replace(" ", "\n") for r in rows]  # "onnxruntime-genai int4" beside four others: two lines
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    series = {"build peak RSS": [r["build_peak_rss_bytes"] or 0 for r in rows],
              "load+generate peak RSS (bs1)": [(r.get("runs") or [{}])[0].get("peak_rss_mib", 0) * 2**20 for r in rows],
              "engine size": [r.get("engine_bytes") or 0 for r in rows]}
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        bars = ax1.bar([x + i * width for x in range(len(rows))], [v / 2**30 for v in values], width, label=label)
        ax1.bar_label(bars, fmt="%.2f", fontsize=7)
    ax1.set_xticks([x + width for x in range(len(rows))], names, fontsize=7)
    ax1.set_ylabel("GiB")
    ax1.set_title(f"memory and disk ({report['checkpoint']['name']})", fontsize=9)
    ax1.legend(fontsize=7)
    width = 0.8 / len(bss)
    for i, b in enumerate(bss):
        # None: not measured (a peer without a batch-b run, or without a byte count): no bar, a dash, not "0%"
        fr = [next((u.get("fraction_of_read") for u in r.get("runs", []) if u["batch_size"] == b), None) for r in rows]
        bars = ax2.bar([x + i * width for x in range(len(rows))], [(f or 0) * 100 for f in fr], width, label=f"bs{b}")
        ax2.bar_label(bars, labels=["–" if f is None else f"{f * 100:.0f}%" for f in fr], fontsize=7)
    ax2.axhline(100, color="tab:red", ls="--", lw=1, label=f"probed read {report['ceiling_gb_s']['read']:.1f} GB/s")
    ax2.set_xticks([x + width * (len(bss) - 1) / 2 for x in range(len(rows))], names, fontsize=7)
    ax2.set_ylabel("% of read bandwidth per decode step")
    ax2.set_title(f"decode vs roofline ({report['machine']['cpu']})", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _csv(kind: type) -> Any:
    return lambda s: [kind(x) for x in s.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Build every precision, measure every engine, print the table, write the JSON and the chart."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="a Hugging Face model folder")
    src.add_argument("--preset", help="make_checkpoint.py preset (llama-3.2-1b, qwen3-8b, qwen3-14b)")
    src.add_argument("--gguf", type=Path, help="a GGUF file: ours built from it (e.g. --precisions gguf,int4), "
                     "llama.cpp run on the file itself")
    ap.add_argument("--layers", type=int, help="--preset: an N-layer slice")
    ap.add_argument("--vocab", type=int, help="--preset: this vocabulary size")
    ap.add_argument("--precisions", type=_csv(str), default=["fp32", "int8", "int4"],
                    help="engines to build; suffixes: P+prefill (--prefill int8), P+bN (--block-size N), "
                    "e.g. int4,int4+b128")
    ap.add_argument("--method", help="int4 --method (default rtn)")
    ap.add_argument("--work", type=Path, default=Path("~/.cache/trtinfer-bench"),
                    help="checkpoints/ and runs/ (a temp folder per run: engines, logs, the default cache)")
    ap.add_argument("--cache", type=Path, help="TRTINFER_CACHE for the builds (default: a fresh one in the run folder)")
    ap.add_argument("--batch-sizes", type=_csv(int), default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=512, help="batch 1 prompt (its TTFT is reported)")
    ap.add_argument("--batch-prompt-len", type=int, default=32, help="prompt of the larger batches")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--buffer-mib", type=float, default=1024, help="bandwidth probe array size")
    ap.add_argument("--oga-python", help="a Python with onnxruntime-genai (benchmarks/peer_workers/setup.sh): adds "
                    "its int4 model, built from the same checkpoint, as a row")
    ap.add_argument("--llama-cpp-python", help="a Python with llama_cpp (benchmarks/peer_workers/setup.sh): adds "
                    "llama.cpp rows, the checkpoint converted and quantized by llama.cpp's own tools")
    ap.add_argument("--llama-cpp-convert", type=Path, help="llama.cpp's convert_hf_to_gguf.py (with its conversion/ "
                    "and gguf-py/ beside it: vendor/llama.cpp of llama-cpp-python's source distribution)")
    ap.add_argument("--llama-cpp-types", type=_csv(str), default=["Q4_0", "Q4_K_M"])
    ap.add_argument("--llama-cpp-outtype", choices=["bf16", "q8_0"], default="bf16",
                    help="the converter's GGUF, which is then quantized: q8_0 where a second bf16 copy of the "
                         "checkpoint does not fit on the disk (the 14B shape here)")
    ap.add_argument("--keep", action="store_true", help="keep the run folder (engines, build logs, default cache)")
    ap.add_argument("--out", type=Path, help="PREFIX of PREFIX.json and PREFIX.png")
    args = ap.parse_args(argv)
    for precision in args.precisions:
        try:
            build_flags(precision)
        except ValueError as e:
            ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    work = args.work.expanduser()
    ckpt_cmd: list[str] | None = None
    if args.gguf and (args.oga_python or args.llama_cpp_convert):
        ap.error("--gguf: llama.cpp runs the file itself (no --llama-cpp-convert); onnxruntime-genai's builder "
                 "takes a Hugging Face folder (no --oga-python)")
    if args.checkpoint or args.gguf:
        ckpt = (args.checkpoint or args.gguf).expanduser().resolve()
    else:
        ckpt, ckpt_cmd = ensure_checkpoint(work, args.preset, args.layers, args.vocab)
    (work / "runs").mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=work / "runs"))
    cache = (args.cache or run_dir / "cache").expanduser().resolve()
    machine, load_before, date = machine_info(), os.getloadavg(), time.strftime("%Y-%m-%d")
    # the code that runs is the checkout's at the start: a commit made while the run goes on is not in it
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True,
                            check=False).stdout.strip()
    rows: list[dict[str, Any]] = []
    try:
        log.info("probing memory bandwidth (%g MiB arrays)", args.buffer_mib)
        probe = roofline.probe_bandwidth(args.buffer_mib)
        int4 = roofline.int4_probes(args.buffer_mib)
        ceiling = {**roofline.ceilings(probe), **roofline.int4_ceilings(int4)}
        for precision in args.precisions:
            engine = run_dir / "engines" / precision
            engine.parent.mkdir(parents=True, exist_ok=True)
            row = build_row(ckpt, precision, args.method, engine, cache)
            if "error" not in row:
                if args.gguf and not (run_dir / "ids.json").is_file():  # the GGUF's vocabulary, as converted
                    prompt_ids(engine / "tokenizer.json", args.prompt_len, run_dir / "ids.json")
                measure_row(row, engine, args.batch_sizes, args.prompt_len, args.batch_prompt_len,
                            args.new_tokens, ceiling)
                if not args.keep:
                    shutil.rmtree(engine)
            rows.append(row)
        if not args.cache and not args.keep:  # its growth is measured: the peers' files need the disk
            shutil.rmtree(cache, ignore_errors=True)
        if args.oga_python:
            rows.append(oga_row(ckpt, args.oga_python, run_dir / "engines" / "oga-int4", args.batch_sizes,
                                args.prompt_len, args.batch_prompt_len, args.new_tokens))
            shutil.rmtree(run_dir / "engines" / "oga-int4", ignore_errors=True)
        if args.llama_cpp_python and args.gguf:
            row = {"precision": "llama.cpp (this GGUF)", "peer": True, "command": [], "cache_growth_bytes": 0,
                   "build_wall_s": None, "build_peak_rss_bytes": None,
                   "version": llama_cpp_version(args.llama_cpp_python)}
            if (run_dir / "ids.json").is_file():
                llama_cpp_runs(row, args.llama_cpp_python, ckpt, run_dir / "ids.json", args.batch_sizes,
                               args.prompt_len, args.new_tokens)
            else:
                row["error"] = "not run: no engine was built, whose tokenizer gives the prompt's ids"
            rows.append(row)
        elif args.llama_cpp_python:
            if not args.llama_cpp_convert:
                ap.error("--llama-cpp-python needs --llama-cpp-convert (llama.cpp's convert_hf_to_gguf.py)")
            rows += llama_cpp_rows(ckpt, args.llama_cpp_python, args.llama_cpp_convert.expanduser(),
                                   run_dir / "engines" / "llama.cpp", args.llama_cpp_types, args.batch_sizes,
                                   args.prompt_len, args.new_tokens, args.llama_cpp_outtype)
        probe_after = roofline.probe_bandwidth(args.buffer_mib)  # a shared machine's bandwidth drifts
        int4 += roofline.int4_probes(args.buffer_mib)
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    ceiling = {**roofline.ceilings(probe, probe_after), **roofline.int4_ceilings(int4)}
    for r in rows:
        for run in (u for u in r.get("runs", []) if "achieved_gb_s" in u):
            run["fraction_of_read"] = run["achieved_gb_s"] / ceiling["read"]  # against the final best-of ceiling
            run["fraction_of_copy"] = run["achieved_gb_s"] / ceiling["copy"]
            if "achieved_gb_s_held" in run:  # ours: counted in the bytes ONNX Runtime's kernels hold and read
                run["fraction_of_read_held"] = run["achieved_gb_s_held"] / ceiling["read"]
            if r["precision"].split("+")[0] == "int4":  # our int4 engines: against the int4 kernel's own ceiling
                run["fraction_of_int4_kernel"] = run["achieved_gb_s"] / ceiling["int4"]
    if args.gguf:
        from trtinfer.gguf_file import GGUFFile

        meta = GGUFFile(ckpt).metadata
        arch = meta.get("general.architecture")
        keys = {"architectures": "general.architecture", "hidden_size": f"{arch}.embedding_length",
                "num_hidden_layers": f"{arch}.block_count", "intermediate_size": f"{arch}.feed_forward_length",
                "vocab_size": f"{arch}.vocab_size", "file_type": "general.file_type"}
        config = {k: meta.get(v) for k, v in keys.items()}
    else:
        config = json.loads((ckpt / "config.json").read_text())
    report = {"machine": machine, "cpu_tag": cpu_kind(machine), "date": date, "git_commit": commit,
              "versions": _versions(), "command": [sys.executable, *sys.argv],
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "checkpoint": {"path": str(ckpt), "name": ckpt.name, "bytes": tree_bytes(ckpt), "made_by": ckpt_cmd,
                             "config": {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers",
                                                                   "intermediate_size", "vocab_size", "dtype",
                                                                   "file_type") if k in config}},
              "settings": {"precisions": args.precisions, "method": args.method, "batch_sizes": args.batch_sizes,
                           "prompt_len": args.prompt_len, "batch_prompt_len": args.batch_prompt_len,
                           "new_tokens": args.new_tokens, "cache": str(cache), "run_dir": str(run_dir),
                           "kept": args.keep},
              "probe": probe, "probe_after": {k: v["gb_s"] for k, v in probe_after["kernels"].items()},
              "int4_kernel_probes": int4,
              "ceiling_gb_s": ceiling, "rows": rows}
    print(format_table(report))
    out = args.out or result_path(f"real_size_{ckpt.stem if args.gguf else ckpt.name}", suffix="", machine=machine)  # one name per model
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out.with_name(out.name + ".json"), out.with_name(out.name + ".png")
    json_path.write_text(json.dumps(report, indent=2))
    chart(report, png_path)
    log.info("wrote %s and %s", json_path, png_path)
    return report


if __name__ == "__main__":
    main()
