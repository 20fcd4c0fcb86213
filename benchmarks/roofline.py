"""The physical limit, measured: the memory bandwidth ONNX Runtime's own thread pool can pull, and how much of it
each engine's decode step uses.

usage: python -m benchmarks.roofline ENGINE_DIR [ENGINE_DIR ...] [--batch-sizes 1 8] [--buffer-mib 1024]
                                     [--threads N] [--prompt-len 128] [--new-tokens 64] [--out FILE.json]

1. Probe: STREAM-style kernels run as one-node ONNX Runtime graphs with ``intra_op_num_threads`` set as the engine
   sets it (``trtinfer.runtime.ort_env.default_intra_op_threads``: the allowed physical cores, 0 = ONNX Runtime's own default),
   over arrays of ``--buffer-mib`` each (far past the caches), inputs and outputs bound once (no allocation, no page
   faults in the timed call), best of ``--repeats``. Bytes as STREAM counts them: read = 1 array (``ReduceMax`` over
   rows, which ONNX Runtime splits over its threads; a full reduction to one scalar runs on one thread), copy = 2
   (``y = x * 1``, an element-wise op ONNX Runtime splits; ``Identity`` is one memcpy on one thread), add = 3
   (``y = a + b``: STREAM's add, the same traffic as its triad). numpy asks for transparent huge pages on big arrays;
   how many the kernel grants varies run to run and moves the figures a lot (measured on a 2-vCPU AMD EPYC VM: read
   ~35 GB/s on 4 KiB pages, ~58 GB/s on huge pages), so each probe records ``anon_huge_pages_mib``. Beside them,
   the int4 kernel's own ceiling (:func:`probe_int4_kernel`: one ``MatMulNBits`` at batch 1 over ``--buffer-mib``
   of packed weights), before and after the engines too: int4 rows also say what fraction of it they reach. And the
   same columns split into one single-thread session per thread, run at once (``int4_split``, recorded only): each
   thread then streams one contiguous part, not ONNX Runtime's interleaved tiles.
2. Bytes one decode step reads (:func:`decode_bytes`), from the decoder graph (``onnx.load(load_external_data=False)``,
   sizes from the initializers and their external-data lengths): every initializer a node uses is read whole, except
   tables that are only gathered from (``Gather`` data, ``GatherBlockQuantized`` data/scales/zero points): one slice
   per token of the batch. So an untied embedding table costs one row, and a table the LM head also reads (tied and
   shared, as in int4 engines) is read whole. Plus the KV cache read at the step's mean length (sliding layers capped
   at their window): layers x 2 x kv_heads x head_dim x length x dtype bytes x batch.
3. Decode step time: ``trtinfer.bench.measure_engine`` (its own process, greedy, the benchmark prompt, best of 3);
   step ms = batch / decode tok/s. Achieved GB/s = bytes per step / step time, and its fraction of the probe's read
   and copy bandwidth (the best of the probes before and after the engines: on a shared VM the bandwidth drifts).

Writes benchmarks/results/roofline_<cpukind>_<date>.json (machine, load average before/after, git commit, probe,
rows) and .png. Weights ONNX Runtime prepacks at load (MatMul B, MatMulNBits blocks) are counted at their stored size;
beside that, ``held``: what ONNX Runtime's CPU int8-compute kernel for ``MatMulNBits`` (``accuracy_level`` 4, every
int4/int8/GGUF-exact engine's) keeps at load and reads every call (:func:`kernel_extra_bytes`): each block's codes and
scale plus a float per block and column, the block's scale times its zero point, which a second pass (an fp32 GEMM of
the activation's block sums by these) adds; zero points themselves are folded into it. For blocks of 32 of 4-bit
codes that is 24 bytes a block against the 20 stored (x1.2; ONNX Runtime 1.32's MLAS, measured by the int4 probe's
``held_bytes``), so ``fraction_of_read_held`` says how much of the bandwidth the kernel's own reads use.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import cpu_kind, git_commit, machine_info

HERE = Path(__file__).parent
GATHER_INPUTS = {"Gather": (0,), "GatherBlockQuantized": (0, 2, 3)}  # inputs read one slice per index
PROBE_KERNELS = {"read": 1, "gemv": 1, "copy": 2, "add": 3}  # kernel -> arrays moved (STREAM's byte count)
KV_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
PROBE_OPS = {"read": "ReduceMax(axis 1) over [1024, n]", "gemv": "MatMul(x [1, 1024], a [1024, n])",
             "copy": "Mul(x, 1)", "add": "Add(a, b)"}
READ_KERNELS = ("read", "gemv")  # kernels that only read their one large array: the read ceiling is their best


def ceilings(*probes: dict[str, Any]) -> dict[str, float]:
    """GB/s per kernel, the best over ``probes`` (:func:`probe_bandwidth` results); ``read`` is the best read-only
    kernel: on a 2-vCPU Sapphire Rapids VM ONNX Runtime's ReduceMax read 19.5 GB/s where its MLAS GEMV (the access
    pattern of a decode step) read 23.8 GB/s, and an fp32 engine's decode then ran at 1.5x the ReduceMax figure."""
    best = {k: max(p["kernels"][k]["gb_s"] for p in probes if k in p["kernels"]) for k in probes[0]["kernels"]}
    best["read"] = max(best[k] for k in READ_KERNELS if k in best)
    return best


def engine_threads() -> int:
    """``intra_op_num_threads`` as the engine's session sets it by default (0: ONNX Runtime's default)."""
    from trtinfer.runtime.ort_env import default_intra_op_threads

    return default_intra_op_threads()


def _physical_cores() -> int:
    from trtinfer.runtime.ort_env import physical_cores

    return physical_cores(os.sched_getaffinity(0))


def _kernel_graph(kernel: str, rows: int, cols: int) -> bytes:
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    x = [helper.make_tensor_value_info(n, f, [rows, cols]) for n in ("a", "b")[:max(1, PROBE_KERNELS[kernel] - 1)]]
    y = helper.make_tensor_value_info("y", f, None)
    inits = []
    if kernel == "read":
        node = helper.make_node("ReduceMax", ["a"], ["y"], axes=[1], keepdims=0)
    elif kernel == "gemv":
        node = helper.make_node("MatMul", ["x", "a"], ["y"])
        inits = [helper.make_tensor("x", f, [1, rows], [1.0] * rows)]
    elif kernel == "copy":
        node = helper.make_node("Mul", ["a", "one"], ["y"])
        inits = [helper.make_tensor("one", f, [], [1.0])]
    else:
        node = helper.make_node("Add", ["a", "b"], ["y"])
    graph = helper.make_graph([node], kernel, x, [y], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString()


def timed_runs(sess: Any, io: Any, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ONNX Runtime session ``sess`` over its bound ``io``."""
    return timed(lambda: sess.run_with_iobinding(io), repeats)


def timed(call: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``call``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def probe_bandwidth(buffer_mib: float = 1024, threads: int | None = None, repeats: int = 5) -> dict[str, Any]:
    """GB/s of each of :data:`PROBE_KERNELS` through ONNX Runtime with ``threads`` intra-op threads (None: the
    engine's default), arrays of ``buffer_mib`` MiB each; best of ``repeats`` timed calls after one warm-up."""
    import onnxruntime as ort

    threads = engine_threads() if threads is None else threads
    rows = 1024  # rows to split over the threads; columns carry the size
    cols = max(1, int(buffer_mib * 2**20) // 4 // rows)
    n = rows * cols
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    arrays = [np.full((rows, cols), 1.0, np.float32), np.full((rows, cols), 2.0, np.float32)]
    out = np.zeros((rows, cols), np.float32)  # written once here, so its pages exist before the clock runs
    huge = _anon_huge_mib()  # numpy madvises big arrays for huge pages; how many it got moves the figures
    kernels = {}
    for kernel, moved in PROBE_KERNELS.items():
        sess = ort.InferenceSession(_kernel_graph(kernel, rows, cols), so, providers=["CPUExecutionProvider"])
        io = sess.io_binding()
        for name, arr in zip(("a", "b"), arrays[:max(1, moved - 1)]):
            io.bind_cpu_input(name, arr)
        y = {"read": np.zeros(rows, np.float32), "gemv": np.zeros((1, cols), np.float32)}.get(kernel, out)
        io.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(y))
        sess.run_with_iobinding(io)
        times = timed_runs(sess, io, repeats)
        expect = {"read": 1.0, "gemv": float(rows), "copy": 1.0, "add": 3.0}[kernel]
        if not np.all(y.reshape(-1)[:4] == expect):  # the result landed in our buffer: no hidden copy elsewhere
            raise RuntimeError(f"probe kernel {kernel} wrote {y[:4]}, expected {expect}")
        nbytes = moved * n * 4
        kernels[kernel] = {"op": PROBE_OPS[kernel], "bytes": nbytes,
                           "best_s": min(times), "gb_s": nbytes / min(times) / 1e9,
                           "all_gb_s": [round(nbytes / t / 1e9, 2) for t in times]}
        del sess, io
    return {"threads": threads, "threads_effective": threads or _physical_cores(), "buffer_bytes": n * 4,
            "repeats": repeats, "anon_huge_pages_mib": huge, "kernels": kernels}


def probe_int4_kernel(buffer_mib: float = 1024, threads: int | None = None, repeats: int = 5,
                      block_size: int = 32, huge_pages: bool = True, split: bool = False) -> dict[str, Any]:
    """GB/s at which ONNX Runtime's int4 kernel streams weights at batch 1: one ``MatMulNBits`` node (K 4096, blocks
    of ``block_size``, fp32 scales, ``accuracy_level`` 4 as int4 engines build it) over ``buffer_mib`` MiB of packed
    weights, stored as the engines store them (external data: ONNX Runtime packs them once at load, as it packs an
    engine's; weights fed as an input are repacked every call, 100x slower), ``x`` [1, K] bound once, best of
    ``repeats`` calls after one warm-up. This is the ceiling an int4 decode step can reach through this kernel
    whatever the graph around it; beside :func:`probe_bandwidth` it says how much of the memory's bandwidth the
    kernel itself leaves unused (2-vCPU AMD EPYC: 25 GB/s on 2 threads and 15-17 on one, whether the read probe gave
    37 or 60 GB/s: compute-bound). ``huge_pages``: the packed blocks moved onto 2 MiB pages as engine sessions
    move theirs (:mod:`trtinfer.runtime.huge_pages`), else left on the 4 KiB pages ONNX Runtime allocates.
    ``split``: the columns cut into one session per thread (1 intra-op thread each), run at once from as many Python
    threads, so each thread streams one contiguous part instead of ONNX Runtime's tiles of both (recorded: whether
    the kernel's rate is its access pattern's or its arithmetic's)."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import onnxruntime as ort

    from trtinfer.runtime.memory import proc_kib, return_freed_memory
    from trtinfer.runtime.page_out import cpu_session

    threads = engine_threads() if threads is None else threads
    parts = (threads or _physical_cores()) if split else 1
    k, blocks = 4096, 4096 // block_size
    n = max(parts, int(buffer_mib * 2**20) // (k // 2 + blocks * 4) // parts * parts)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1 if split else threads
    so.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="trtinfer-int4-probe-") as tmp:
        written = [_write_int4(k, n // parts, block_size, Path(tmp) / f"int4-{i}.onnx") for i in range(parts)]
        return_freed_memory()
        anon_before = proc_kib("/proc/self/smaps_rollup", "Anonymous")
        sessions = [cpu_session(str(path), so, Path(tmp), huge_pages=huge_pages) for path, _ in written]
    runs = []
    for sess in sessions:
        x, y = np.ones((1, k), np.float32), np.zeros((1, n // parts), np.float32)
        io = sess.io_binding()
        io.bind_cpu_input("x", x)
        io.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(y))
        sess.run_with_iobinding(io)
        runs.append((sess, io, y, x))  # x kept: the binding reads its buffer
    return_freed_memory()  # what the load freed (the blocks read in to be packed) is not what it holds
    anon_after = proc_kib("/proc/self/smaps_rollup", "Anonymous")
    anon_growth = None if anon_before is None or anon_after is None else (anon_after - anon_before) * 1024
    if not split:
        times = timed_runs(*runs[0][:2], repeats)
    else:
        with ThreadPoolExecutor(parts) as pool:
            def run_all() -> None:
                list(pool.map(lambda run: run[0].run_with_iobinding(run[1]), runs))

            run_all()  # the pool's threads started before the clock runs
            times = timed(run_all, repeats)
    for _, _, y, _ in runs:
        if not np.all(y[0, :4] == k):  # every weight 1, x all ones: each output is K
            raise RuntimeError(f"int4 probe wrote {y[0, :4]}, expected {k}")
    nbytes = n * (k // 2 + blocks * 4)
    held = nbytes + sum(kernel_extra_bytes(node, {}) for _, node in written)  # + a float per block and column
    form = f"{parts} sessions of 1 thread, run at once, {n // parts} columns each" if split else f"{n} columns"
    return {"op": f"MatMulNBits(x [1, {k}], {form}, blocks of {block_size}, accuracy_level 4)",
            "threads": threads, "threads_effective": threads or _physical_cores(), "split": split, "bytes": nbytes,
            "held_bytes": held, "anon_growth_at_load_bytes": anon_growth, "gb_s_held": held / min(times) / 1e9,
            "huge_pages": huge_pages, "anon_huge_pages_mib": _anon_huge_mib(),
            "best_s": min(times), "gb_s": nbytes / min(times) / 1e9,
            "all_gb_s": [round(nbytes / t / 1e9, 2) for t in times]}


def _write_int4(k: int, n: int, block_size: int, path: Path) -> tuple[Path, Any]:
    """(``path``, node): one ``MatMulNBits`` over ``n`` columns of 4-bit weights all 1, saved with its weights as
    external data (as engines store theirs)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    blocks = k // block_size
    codes = np.full((n, blocks, block_size // 2), 0x99, np.uint8)  # every weight 9 - zero point 8 = 1
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block_size, accuracy_level=4)
    graph = helper.make_graph([node], "int4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              initializer=[numpy_helper.from_array(codes, "b"),
                                           numpy_helper.from_array(np.ones(n * blocks, np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.stem + ".data", size_threshold=0)
    return path, node


def int4_probes(buffer_mib: float = 1024, threads: int | None = None, repeats: int = 5,
                split: bool = False) -> list[dict[str, Any]]:
    """:func:`probe_int4_kernel` with its packed blocks on huge pages (as engines run) and on 4 KiB pages; with
    ``split``, also split into one single-thread session per thread (on huge pages), right after them."""
    return ([probe_int4_kernel(buffer_mib, threads, repeats, huge_pages=h) for h in (True, False)]
            + ([probe_int4_kernel(buffer_mib, threads, repeats, split=True)] if split else []))


def int4_ceilings(probes: list[dict[str, Any]]) -> dict[str, float]:
    """``int4``: the best GB/s of the :func:`int4_probes` on huge pages (the ceiling int4 rows are set against);
    ``int4_4k``: the best on 4 KiB pages (recorded: what huge pages gain); ``int4_split``: the best split into one
    session per thread (recorded: whether another division of the work streams faster); ``int4_held``: the
    huge-page best counted in the bytes the kernel holds and reads (:func:`kernel_extra_bytes`), the basis of rows'
    ``fraction_of_read_held``."""
    best: dict[str, float] = {}
    for p in probes:
        name = "int4_split" if p.get("split") else "int4" if p["huge_pages"] else "int4_4k"
        best[name] = max(best.get(name, 0.0), p["gb_s"])
        if name == "int4":
            best["int4_held"] = max(best.get("int4_held", 0.0), p["gb_s_held"])
    return best


def _anon_huge_mib() -> float | None:
    """This process's anonymous memory backed by transparent huge pages (MiB), or None where Linux does not say."""
    from trtinfer.runtime.memory import proc_kib

    kib = proc_kib("/proc/self/smaps_rollup", "AnonHugePages")
    return None if kib is None else kib / 1024


def stored_at(t: Any) -> Any:
    """Where an initializer's bytes are: (file, offset) for external data, else its name."""
    where = {kv.key: kv.value for kv in t.external_data}
    return (where["location"], int(where.get("offset", 0))) if "location" in where else t.name


def _nbytes(t: Any) -> int:
    """Stored size of an initializer: its external-data length, raw bytes, or element count x element size."""
    from onnx import helper

    for kv in t.external_data:
        if kv.key == "length":
            return int(kv.value)
    if t.raw_data:
        return len(t.raw_data)
    count = math.prod(t.dims)
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def decode_bytes(engine_dir: str | Path, batch_size: int = 1, kv_len: float = 0.0) -> dict[str, Any]:
    """Bytes one decode step of ``batch_size`` rows reads: weights (see the module docstring), gathered slices and
    the KV cache at ``kv_len`` entries per row. Returns the parts and the ``total``."""
    import onnx

    from trtinfer.artifact import kv_dtype, read_manifest

    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    model = onnx.load(str(engine_dir / manifest.files["decoder"]), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    # readers of the same stored bytes count once: the builder gives each reader of a shared (tied) table its own
    # initializer name over one region of the data file (trtinfer/builder/weight_views.py)
    uses: dict[Any, list[tuple[Any, int]]] = {}
    first: dict[Any, str] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name in inits:
                key = stored_at(inits[name])
                first.setdefault(key, name)
                uses.setdefault(key, []).append((node, i))
    whole, gathered, tables = 0, 0, []
    held_extra = sum(kernel_extra_bytes(node, inits) for node in model.graph.node if node.op_type == "MatMulNBits")
    for key, used in uses.items():
        name = first[key]
        size = _nbytes(inits[name])
        if all(i in GATHER_INPUTS.get(node.op_type, ()) for node, i in used):
            axis = max({_gather_axis(node) for node, _ in used})
            dims = list(inits[name].dims)
            part = size // dims[axis] * batch_size if dims else size
            gathered += part
            tables.append({"name": name, "table_bytes": size, "read_bytes": part})
        else:
            whole += size
    geo = manifest.geometry
    itemsize = KV_ITEMSIZE[kv_dtype(manifest.raw["io"])]
    types = geo.get("layer_types") or ["full_attention"] * geo["num_layers"]
    window = geo.get("sliding_window")
    lengths = [min(kv_len, window) if window and t == "sliding_attention" else kv_len for t in types]
    kv = batch_size * 2 * geo["num_kv_heads"] * geo["head_dim"] * itemsize * sum(lengths)
    return {"weights_bytes": whole, "gathered_bytes": gathered, "gathered_tables": tables, "kv_bytes": kv,
            "kv_len": kv_len, "kv_dtype": kv_dtype(manifest.raw["io"]), "total": whole + gathered + kv,
            "held_extra_bytes": held_extra, "total_held": whole + gathered + kv + held_extra}


def kernel_extra_bytes(node: Any, inits: dict[str, Any]) -> int:
    """Bytes ONNX Runtime's CPU kernel reads for one ``MatMulNBits`` beyond the initializers it stores: at
    ``accuracy_level`` 4 (int8 compute) MLAS packs, beside each block's codes and scale, one float per block and column
    (the block's scale x its zero point: 8 for symmetric 4-bit codes), which it reads in a second pass over every
    call; a zero-point input is folded into those and not read. Other levels pack the codes alone: 0."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("accuracy_level", 0) != 4:
        return 0
    k, n, block = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
    extra = n * -(-k // block) * 4
    zero_points = node.input[3] if len(node.input) > 3 else ""
    return extra - (_nbytes(inits[zero_points]) if zero_points in inits else 0)


def _gather_axis(node: Any) -> int:
    from onnx import helper

    for a in node.attribute:
        if a.name in ("axis", "gather_axis"):
            return int(helper.get_attribute_value(a))
    return 0


def measure_decode(engine_dir: Path, batch_size: int, prompt_len: int, new_tokens: int) -> Any:
    """``trtinfer.bench.measure_engine``: the engine in its own process, greedy, best of 3 decode rates."""
    from trtinfer.bench import measure_engine

    return measure_engine(engine_dir, batch_size, prompt_len, new_tokens)


def roofline_row(engine_dir: Path, batch_size: int, prompt_len: int, new_tokens: int, res: Any,
                 ceiling: dict[str, float]) -> dict[str, Any]:
    """Relate one measured decode (a ``BenchResult``) to the bytes its step reads and to ``ceiling`` (GB/s per probe
    kernel: the best of the probes before and after the engines; ``int4``, where present, the int4 kernel's probe,
    which int4 engines' rows are also set against)."""
    from trtinfer.artifact import read_manifest

    step_s = batch_size / res.decode_tok_s
    counted = decode_bytes(engine_dir, batch_size, prompt_len + new_tokens / 2)  # steps 1..N-1 hold prompt+k
    achieved = counted["total"] / step_s / 1e9
    achieved_held = counted["total_held"] / step_s / 1e9
    raw = read_manifest(engine_dir).raw
    return {"engine": engine_dir.name, "path": str(engine_dir), "model": raw["source"].get("model"),
            "precision": raw.get("precision"), "kv_layout": raw.get("kv_layout"), "batch_size": batch_size,
            "decode_tok_s": res.decode_tok_s, "step_ms": step_s * 1000, "bytes_per_step": counted["total"],
            "counted": counted, "achieved_gb_s": achieved, "fraction_of_read": achieved / ceiling["read"],
            "fraction_of_copy": achieved / ceiling["copy"], "first_tokens": res.first_tokens,
            "bytes_per_step_held": counted["total_held"], "achieved_gb_s_held": achieved_held,
            "fraction_of_read_held": achieved_held / ceiling["read"],
            **({"fraction_of_int4_kernel": achieved / ceiling["int4"]}
               if "int4" in ceiling and raw.get("precision") == "int4" else {})}


def format_table(report: dict[str, Any]) -> str:
    """Markdown tables: the probe, then one row per engine and batch size."""
    p = report["probe"]
    other = "".join(f"; {t} thread(s): " + ", ".join(f"{k} {v:.1f}" for k, v in kv.items())
                    for t, kv in report.get("probe_other_threads", {}).items())
    ceiling = ", ".join(f"{k} {v:.1f}" for k, v in report["ceiling_gb_s"].items())
    lines = [f"probe: {p['threads_effective']} threads, {p['buffer_bytes'] / 2**20:.0f} MiB arrays, best of "
             f"{p['repeats']}: " + ", ".join(f"{k} {v['gb_s']:.1f} GB/s" for k, v in p["kernels"].items())
             + "; after the engines: " + ", ".join(f"{k} {v:.1f}" for k, v in report["probe_after"].items()) + other
             + f"; fractions use the best of before/after: {ceiling} GB/s",
             "", ("| engine | bs | decode tok/s | step ms | MiB/step (weights + gathered + KV) | GB/s | of read "
                  "| of copy | of int4 kernel | MiB/step held, GB/s, of read |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        c = r["counted"]
        lines.append(f"| {r['engine']} | {r['batch_size']} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | "
                     f"{r['bytes_per_step'] / 2**20:.1f} ({c['weights_bytes'] / 2**20:.1f} + "
                     f"{c['gathered_bytes'] / 2**20:.2f} + {c['kv_bytes'] / 2**20:.1f}) | {r['achieved_gb_s']:.1f} | "
                     f"{r['fraction_of_read']:.0%} | {r['fraction_of_copy']:.0%} | "
                     + (f"{r['fraction_of_int4_kernel']:.0%} |" if "fraction_of_int4_kernel" in r else "– |")
                     + f" {r['bytes_per_step_held'] / 2**20:.1f}, {r['achieved_gb_s_held']:.1f}, "
                       f"{r['fraction_of_read_held']:.0%} |")
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    """Bars: each engine's achieved GB/s per decode step; lines: the probe's read and copy bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(rows) + 2), 5.5))
    stored = [r["achieved_gb_s"] for r in rows]
    ax.bar(range(len(rows)), stored, color="tab:blue", label="engine's stored bytes")
    held = [r.get("achieved_gb_s_held", s) - s for r, s in zip(rows, stored)]
    bars = ax.bar(range(len(rows)), held, bottom=stored, color="lightsteelblue",
                  label="+ what the int8-compute kernel also reads (a float per block and column)")
    ax.bar_label(bars, labels=[f"{r['achieved_gb_s']:.1f} ({r['fraction_of_read']:.0%} of read)"
                               + (f"\nheld {r['achieved_gb_s_held']:.1f} ({r['fraction_of_read_held']:.0%})"
                                  if h > 0 else "") for r, h in zip(rows, held)], fontsize=7)
    shown = [kv for kv in report["ceiling_gb_s"].items() if not kv[0].startswith("int4")][:3]
    shown += [("int4", report["ceiling_gb_s"]["int4"])] if "int4" in report["ceiling_gb_s"] else []
    for (kernel, v), color in zip(shown, ("tab:red", "tab:orange", "tab:green", "tab:purple")):
        name = "int4 kernel (MatMulNBits, batch 1)" if kernel == "int4" else f"probe {kernel}"
        ax.axhline(v, color=color, ls="--", lw=1, label=f"{name} {v:.1f} GB/s")
        if kernel == "int4" and "int4_held" in report["ceiling_gb_s"]:
            held_v = report["ceiling_gb_s"]["int4_held"]
            ax.axhline(held_v, color=color, ls=":", lw=1, label=f"{name}, counting what it holds, {held_v:.1f} GB/s")
    ax.set_xticks(range(len(rows)), [f"{r['engine']}\nbs{r['batch_size']}" for r in rows], fontsize=7)
    ax.set_ylabel("GB/s read per decode step")
    ax.set_title(f"decode vs measured memory bandwidth ({report['machine']['cpu']}, "
                 f"{report['probe']['threads_effective']} threads)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the probe, measure every engine at every batch size, print the table, write the JSON and the chart."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="+", type=Path, help="engine directories")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--buffer-mib", type=float, default=1024, help="size of each probe array")
    ap.add_argument("--repeats", type=int, default=10, help="probe repetitions (best is kept)")
    ap.add_argument("--threads", type=int, default=None, help="probe threads (default: the engine's)")
    ap.add_argument("--extra-threads", nargs="*", type=int, default=[1],
                    help="also probe at these thread counts (recorded, not used for the fractions)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    load_before = os.getloadavg()
    machine = machine_info()
    probe = probe_bandwidth(args.buffer_mib, args.threads, args.repeats)
    int4 = int4_probes(args.buffer_mib, args.threads, args.repeats, split=True)
    measured = [(e, bs, measure_decode(e, bs, args.prompt_len, args.new_tokens)) for e in args.engines
                for bs in args.batch_sizes]
    probe_after = probe_bandwidth(args.buffer_mib, args.threads, args.repeats)  # the bandwidth drifts: probe again
    int4 += int4_probes(args.buffer_mib, args.threads, args.repeats, split=True)
    ceiling = {**ceilings(probe, probe_after), **int4_ceilings(int4)}
    rows = [roofline_row(e, bs, args.prompt_len, args.new_tokens, res, ceiling) for e, bs, res in measured]
    extra = {str(t): {**{k: round(v["gb_s"], 2) for k, v in probe_bandwidth(args.buffer_mib, t, args.repeats)
                         ["kernels"].items()}, "int4": round(probe_int4_kernel(args.buffer_mib, t, args.repeats)
                                                            ["gb_s"], 2)}
             for t in args.extra_threads if t != probe["threads_effective"]}
    huge = {"before": probe["anon_huge_pages_mib"], "after": probe_after["anon_huge_pages_mib"]}
    date = time.strftime("%Y-%m-%d")
    report = {"machine": machine, "date": date, "git_commit": git_commit(),
              "load_average": {"before": load_before, "after": os.getloadavg()},
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "probe": probe,
              "probe_after": {k: round(v["gb_s"], 2) for k, v in probe_after["kernels"].items()},
              "probe_anon_huge_pages_mib": huge, "int4_kernel_probes": int4,
              "probe_other_threads": extra,
              "ceiling_gb_s": ceiling, "rows": rows}
    print(format_table(report))
    out = args.out or HERE / "results" / f"roofline_{cpu_kind(machine)}_{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    chart(report, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
