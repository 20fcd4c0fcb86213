"""Which int8 form is fastest on this CPU: 8-bit MatMulNBits (accuracy level 4) or DynamicQuantizeMatMul.

usage: python -m benchmarks.int8_forms [--model smollm2-135m]
Both are made from the same optimized fp32 graph: ours with ``trtinfer quantize --precision int8`` (symmetric
blocks of 32, int8 compute), the other with ``onnxruntime.quantization.quantize_dynamic`` (per-channel int8
weights, activations quantized per call: ORT fuses it into DynamicQuantizeMatMul). Times one decode step (batch 1,
128 tokens of context) and a 128-token prefill with ONNX Runtime directly, and perplexity on 512 held-out tokens.
Writes benchmarks/results/int8_forms.json.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.machine import machine_info, result_path

HERE = Path(__file__).parent


def timings(path: Path, reps: int = 40) -> dict[str, float]:
    """Median decode step and best prefill (ms) of a shared-buffer graph, batch 1."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in s.get_inputs()}
    past = [n for n in ins if n.startswith("past_key_values.")]
    present = [o.name for o in s.get_outputs() if o.name.startswith("present.")]
    kvh, hd = ins[past[0]].shape[1], ins[past[0]].shape[3]
    bufs = [ort.OrtValue.ortvalue_from_numpy(np.zeros((1, kvh, 256, hd), np.float32)) for _ in past]

    def run(ids: np.ndarray, done: int) -> float:
        n = ids.shape[1]
        io = s.io_binding()
        feeds = {"input_ids": ids, "seqlens_k": np.array([done + n - 1], np.int32),
                 "total_sequence_length": np.array(done + n, np.int32), "logits_positions": np.array([[n - 1]])}
        for k, v in feeds.items():
            if k in ins:
                io.bind_cpu_input(k, v)
        for k, b in zip(past, bufs):
            io.bind_ortvalue_input(k, b)
        for k, b in zip(present, bufs):
            io.bind_ortvalue_output(k, b)
        io.bind_output("logits", "cpu")
        t0 = time.perf_counter()
        s.run_with_iobinding(io)
        return (time.perf_counter() - t0) * 1000

    ids = np.random.default_rng(0).integers(100, 20000, (1, 128))
    prefill = min(run(ids, 0) for _ in range(3))
    steps = [run(np.array([[7]]), 128 + (i % 64)) for i in range(reps)]
    return {"prefill_ms": round(prefill, 2), "decode_ms": round(float(np.median(steps)), 3)}


def perplexity(stage_dir: Path, onnx_path: Path, tokens: int = 512) -> float:
    from trtinfer.artifact import StageDir, read_stage
    from trtinfer.quantization.accuracy import held_out_ids
    from trtinfer.runtime.scoring import open_stage_session, score_ids
    from trtinfer.stages import graph_io

    st = read_stage(stage_dir, verify=False)
    view = StageDir(onnx_path.parent, {**st.info, "io": graph_io(onnx_path)})
    ids = held_out_ids(st.path / "tokenizer.json", tokens)
    with open_stage_session(view) as sess:
        return score_ids(sess, ids).perplexity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from trtinfer.artifact import STAGE_FILE
    from trtinfer.builder import BuildConfig
    from trtinfer.export.onnx_export import export_cached
    from trtinfer.export.sources import resolve_model
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_cached
    from trtinfer.quantization import QuantConfig, quantize_cached

    cfg = BuildConfig()
    exp = export_cached(resolve_model(args.model), cfg.export)
    opt = optimize_cached(exp, PassConfig(max_seq_len=cfg.max_seq_len_for(exp.geometry)))
    ours = quantize_cached(opt, QuantConfig(precision="int8"), progress=False)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        dyn = Path(tmp) / "model.onnx"
        quantize_dynamic(str(opt.onnx_path), str(dyn), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                         op_types_to_quantize=["MatMul"], use_external_data_format=True)
        (Path(tmp) / STAGE_FILE).write_text((opt.path / STAGE_FILE).read_text())
        for name, path, stage in (("fp32", opt.onnx_path, opt.path), ("MatMulNBits 8-bit level 4 (trtinfer int8)",
                                                                       ours.onnx_path, opt.path),
                                  ("DynamicQuantizeMatMul (quantize_dynamic, reduce_range)", dyn, opt.path)):
            t = timings(path)
            ppl = perplexity(stage, path)
            rows[name] = {**t, "perplexity": round(ppl, 4), "size_mib": round(sum(
                f.stat().st_size for f in path.parent.iterdir() if f.name.startswith(path.name)) / 2**20, 1)}
            print(f"{name:<44} prefill {t['prefill_ms']:7.1f} ms  decode {t['decode_ms']:6.2f} ms/step  "
                  f"ppl {ppl:.3f}", flush=True)
    base = rows["fp32"]["perplexity"]
    for r in rows.values():
        r["perplexity_vs_fp32"] = round(r["perplexity"] / base, 4) if math.isfinite(r["perplexity"]) else None
    out = result_path("int8_forms")
    out.write_text(json.dumps({"machine": machine_info(), "model": args.model, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
