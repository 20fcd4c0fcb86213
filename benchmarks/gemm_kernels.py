"""What ONNX Runtime's CPU GEMM kernels reach at one weight shape, per batch of rows: the ops an engine's prefill
(many rows) and decode (1 or a few rows) could run on, each as a one-node graph (or, for the runtime int4->int8 form,
a small chain) with random weights, ``intra_op_num_threads`` as the engine sets it.

usage: python -m benchmarks.gemm_kernels [--k 5120] [--n 17408] [--rows 1,8,512] [--repeats 5] [--out PREFIX]

Forms (weights [K, N], activations [rows, K] fp32):
- ``MatMul fp32``: MLAS SGEMM over prepacked fp32 weights (an fp32 engine).
- ``MatMulNBits 4-bit, blocks of B, accuracy_level L``: an int4 engine's kernel (L 4: int8 activations, the build's
  default; L 0: fp32 arithmetic).
- ``DynamicQuantizeMatMul int8``: per-tensor uint8 activations x int8 weights (the u8 x s8 GEMM: VNNI, AMX where the
  CPU has it), weights prepacked; what an int8 prefill graph's GEMMs run on.
- ``int4 -> int8 at run time``: the int4 weights dequantized (blocked ``DequantizeLinear``, opset 21), quantized
  per channel to int8 (``QuantizeLinear``) and multiplied by ``MatMulInteger``, every call: a prefill that needs no
  resident int8 copy of the weights (only at the largest row count: it is a prefill form).

Rate = 2 x rows x K x N / best-of-``repeats`` seconds (after one warm-up call; input and output bound once, timed by
``roofline.timed_runs``). Prints one table, writes PREFIX.json
(figures, CPU flags, versions) and PREFIX.png; PREFIX defaults to benchmarks/results/gemm_kernels_<machine kind>_<date>.
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.machine import git_commit, machine_info, result_path
from benchmarks.roofline import engine_threads, timed_runs

log = logging.getLogger("benchmarks.gemm_kernels")


def _model(nodes: list[Any], inits: list[Any], k: int, n: int) -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", n])], inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def forms(k: int, n: int, rng: np.random.Generator) -> dict[str, Callable[[], bytes]]:
    """Form name -> a function making its one-graph model."""
    from onnx import TensorProto, helper, numpy_helper

    def nbits(block: int, level: int) -> bytes:
        blocks = k // block
        b = numpy_helper.from_array(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8), "B")
        s = numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 0.01, "S")
        node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=block, accuracy_level=level)
        return _model([node], [b, s], k, n)

    def fp32() -> bytes:
        w = numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * 0.02, "W")
        return _model([helper.make_node("MatMul", ["A", "W"], ["Y"])], [w], k, n)

    def int8() -> bytes:
        w = numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), "W")
        s = numpy_helper.from_array(np.full(n, 1e-3, np.float32), "S")
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "W", "S"], ["Y"], domain="com.microsoft")
        return _model([node], [w, s], k, n)

    def int4_to_int8() -> bytes:
        w4 = helper.make_tensor("W4", TensorProto.INT4, [k, n], rng.integers(0, 256, k * n // 2, dtype=np.uint8)
                                .tobytes(), raw=True)
        s = numpy_helper.from_array(rng.random((k // 32, n), dtype=np.float32) * 0.01, "S")
        sc = numpy_helper.from_array(np.full(n, 1e-3, np.float32), "SC")
        nodes = [helper.make_node("DequantizeLinear", ["W4", "S"], ["Wf"], axis=0, block_size=32),
                 helper.make_node("QuantizeLinear", ["Wf", "SC"], ["W8"], axis=1, output_dtype=TensorProto.INT8),
                 helper.make_node("DynamicQuantizeLinear", ["A"], ["Aq", "as", "az"]),
                 helper.make_node("MatMulInteger", ["Aq", "W8", "az"], ["Yi"]),
                 helper.make_node("Cast", ["Yi"], ["Yf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["as", "SC"], ["s2"]), helper.make_node("Mul", ["Yf", "s2"], ["Y"])]
        return _model(nodes, [w4, s, sc], k, n)

    return {"MatMul fp32": fp32, "MatMulNBits 4-bit b32 acc4": lambda: nbits(32, 4),
            "MatMulNBits 4-bit b32 acc0": lambda: nbits(32, 0), "MatMulNBits 4-bit b128 acc4": lambda: nbits(128, 4),
            "DynamicQuantizeMatMul int8": int8, "int4 -> int8 at run time": int4_to_int8}


def measure(model: bytes, rows: list[int], k: int, threads: int, repeats: int, folding: bool) -> dict[int, float]:
    """Rows -> GOPS of one model (best of ``repeats``)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if not folding:  # the runtime form's weights must stay weights: constant folding would make it an int8 copy
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    n = sess.get_outputs()[0].shape[1]
    out = {}
    for m in rows:
        a, y = np.random.default_rng(1).random((m, k), dtype=np.float32), np.zeros((m, n), np.float32)
        io = sess.io_binding()  # inputs and output bound once, as the roofline's probes time their kernels
        io.bind_cpu_input("A", a)
        io.bind_ortvalue_output("Y", ort.OrtValue.ortvalue_from_numpy(y))
        sess.run_with_iobinding(io)
        out[m] = 2 * m * k * n / min(timed_runs(sess, io, repeats)) / 1e9
    return out


def chart(report: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(report["gops"])
    rows = report["settings"]["rows"]
    width = 0.8 / len(rows)
    for i, m in enumerate(rows):
        vals = [report["gops"][f].get(str(m), 0) for f in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=f"{m} rows")
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(names))], names, rotation=20, ha="right",
                  fontsize=7)
    ax.set_ylabel("GOPS")
    ax.set_yscale("log")
    ax.set_title(f"ONNX Runtime CPU GEMMs, K={report['settings']['k']} N={report['settings']['n']} "
                 f"({report['machine'].get('cpu', '')[:40]})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--n", type=int, default=17408)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="PREFIX of PREFIX.json and PREFIX.png")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import onnxruntime as ort

    threads, rng, info = engine_threads(), np.random.default_rng(0), machine_info()
    gops: dict[str, dict[str, float]] = {}
    for name, make in forms(args.k, args.n, rng).items():
        runtime = name.startswith("int4 -> int8")
        rows = [max(args.rows)] if runtime else args.rows
        log.info("%s at %s rows", name, rows)
        gops[name] = {str(m): round(v, 1) for m, v in
                      measure(make(), rows, args.k, threads, args.repeats, folding=not runtime).items()}
    report = {"machine": info, "git_commit": git_commit(), "versions": {"onnxruntime": ort.__version__},
              "settings": {"k": args.k, "n": args.n, "rows": args.rows, "repeats": args.repeats, "threads": threads},
              "gops": gops}
    print(f"| form | {' | '.join(f'{m} rows GOPS' for m in args.rows)} |")
    print("|---|" + "---|" * len(args.rows))
    for name, by_rows in gops.items():
        print(f"| {name} | {' | '.join(str(by_rows.get(str(m), '–')) for m in args.rows)} |")
    base = args.out or str(result_path("gemm_kernels", "", info))
    with open(f"{base}.json", "w") as f:
        json.dump(report, f, indent=1)
    chart(report, f"{base}.png")
    log.info("wrote %s.json and %s.png", base, base)


if __name__ == "__main__":
    main()
