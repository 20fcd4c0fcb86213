"""Where a decode step's time goes: ONNX Runtime's profiler over one engine's decode step, per op type and per
projection, with the bytes each projection streams per step and the rate it streams them at.

usage: python -m benchmarks.step_profile ENGINE_DIR [ENGINE_DIR ...] [--batch-size 1] [--past 512] [--steps 15]

Each engine (a shared-buffer ONNX Runtime engine: past and present bound to one buffer per layer, as the runtime
binds them) runs ``--steps`` timed decode steps after 3 warm-up steps, with ``--past`` positions of context, the
engine's own thread count, in this process, after a bandwidth probe (``benchmarks.roofline.probe_bandwidth``); then the same steps again with the profiler on. Per MatMulNBits / MatMul
node the bytes are its initializers' (weights, scales, zero points), so "GB/s" is the rate a projection reads its
weights at: beside a bandwidth probe of the same sitting (``benchmarks.roofline``) it says whether a kernel is
bandwidth- or compute-bound. Writes benchmarks/results/step_profile_<cpu kind>_<date>.json.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.machine import git_commit, machine_info, result_path
from benchmarks.roofline import probe_bandwidth, timed_runs

GROUPS = ("q_proj", "o_proj", "gate_proj", "down_proj", "lm_head")  # packed QKV / gate-up keep the first name


def group_of(node: str) -> str:
    return next((g for g in GROUPS if g in node), "other")


def node_bytes(model_path: Path) -> dict[str, int]:
    """Initializer bytes each weight-reading node reads (external data lengths; no weights loaded)."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    sizes: dict[str, int] = {}
    for t in m.graph.initializer:
        ext = {e.key: e.value for e in t.external_data}
        sizes[t.name] = int(ext["length"]) if "length" in ext else len(t.raw_data)
    return {n.name: sum(sizes.get(i, 0) for i in n.input) for n in m.graph.node
            if n.op_type in ("MatMulNBits", "MatMul", "FusedMatMul")}


def profile(engine: Path, batch: int, past: int, steps: int) -> dict[str, Any]:
    import onnxruntime as ort

    from trtinfer.runtime.ort_env import default_intra_op_threads

    def session(prof: bool) -> Any:
        so = ort.SessionOptions()
        so.intra_op_num_threads = default_intra_op_threads()
        so.log_severity_level = 3
        if prof:
            so.enable_profiling = True
            so.profile_file_prefix = str(Path("/tmp") / f"step_profile_{engine.name}")
        return ort.InferenceSession(str(engine / "model.onnx"), so, providers=["CPUExecutionProvider"])

    def bind(s: Any) -> tuple[Any, list[Any]]:
        ins = {i.name: i for i in s.get_inputs()}
        if "seqlens_k" not in ins:
            raise SystemExit(f"{engine}: not a shared-buffer engine (no seqlens_k input)")
        b = s.io_binding()
        b.bind_cpu_input("input_ids", np.full((batch, 1), 1000, np.int64))
        b.bind_cpu_input("seqlens_k", np.full((batch,), past, np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(past + 1, np.int32))
        if "logits_positions" in ins:
            b.bind_cpu_input("logits_positions", np.zeros((batch, 1), np.int64))
        keep = []
        for name, i in ins.items():
            if name.startswith("past_key_values."):
                dtype = np.float16 if "float16" in i.type else np.float32
                v = ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, i.shape[1], past + 64, i.shape[3]), dtype))
                keep.append(v)
                b.bind_ortvalue_input(name, v)
                b.bind_ortvalue_output(name.replace("past_key_values", "present"), v)
        b.bind_output("logits")
        return b, keep

    s = session(False)
    b, _keep = bind(s)
    for _ in range(3):
        s.run_with_iobinding(b)
    times = timed_runs(s, b, steps)
    del s, b, _keep
    s = session(True)
    b, _keep = bind(s)
    for _ in range(3 + steps):
        s.run_with_iobinding(b)
    trace = Path(s.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()  # ONNX Runtime's trace file: read, then gone (each run wrote one more into /tmp)
    runs = 3 + steps
    by_op: Counter[str] = Counter()
    by_node: Counter[str] = Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"]
            by_node[e["name"].removesuffix("_kernel_time")] += e["dur"]
    sizes = node_bytes(engine / "model.onnx")
    groups: dict[str, dict[str, float]] = {}
    for node, nbytes in sizes.items():
        g = groups.setdefault(group_of(node), {"ms": 0.0, "bytes": 0})
        g["ms"] += by_node.get(node, 0) / runs / 1e3
        g["bytes"] += nbytes
    for g in groups.values():
        g["gb_s"] = round(g["bytes"] / (g["ms"] / 1e3) / 1e9, 2) if g["ms"] else None
        g["ms"] = round(g["ms"], 3)
    return {"engine": str(engine), "batch_size": batch, "past": past,
            "step_ms_best": round(min(times) * 1e3, 2), "step_ms_median": round(float(np.median(times)) * 1e3, 2),
            "profiled_ms_by_op": {k: round(v / runs / 1e3, 3) for k, v in by_op.most_common()},
            "projections": groups}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="+", type=Path)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    probe = probe_bandwidth()
    print("probe GB/s: " + ", ".join(f"{k} {v['gb_s']:.1f}" for k, v in probe["kernels"].items()))
    rows = []
    for engine in args.engines:
        r = profile(engine, args.batch_size, args.past, args.steps)
        rows.append(r)
        print(f"{engine}: bs{r['batch_size']} past {r['past']}: best {r['step_ms_best']} ms, median "
              f"{r['step_ms_median']} ms")
        for op, ms in list(r["profiled_ms_by_op"].items())[:6]:
            print(f"  {op:<34} {ms:8.2f} ms")
        for g, v in sorted(r["projections"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"    {g:<12} {v['ms']:8.2f} ms  {v['bytes'] / 2**20:8.1f} MiB  {v['gb_s']} GB/s")
    out = result_path("step_profile")
    out.write_text(json.dumps({"machine": machine_info(), "git_commit": git_commit(), "probe": probe, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
