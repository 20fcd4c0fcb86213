"""Which weight form is fastest on this CPU, and what it costs in accuracy: MatMulNBits (8-bit and 4-bit, blocks of
32 and 128, accuracy level 4: int8 compute) or DynamicQuantizeMatMul.

usage: python -m benchmarks.int8_forms [--model smollm2-135m]
All are made from the same optimized fp32 graph: ours with ``trtinfer quantize`` (int8; int4 round-to-nearest with
blocks of 32, the default, and of 128), the others with ``onnxruntime.quantization.quantize_dynamic`` (per-channel
int8 weights, activations quantized per tensor per call: ORT fuses it into DynamicQuantizeMatMul), with and without
``reduce_range`` (7-bit weights: what CPUs without VNNI need to avoid overflow). Times one decode step (batch 1, 128
tokens of context) and a 128-token prefill with ONNX Runtime directly, and perplexity on 512 held-out tokens.
The question it answers: whether a prefill path in another form would buy TTFT (DynamicQuantizeMatMul runs MLAS's
int8 GEMM, MatMulNBits a per-block kernel) and at what perplexity. Writes benchmarks/results/int8_forms_<cpu>_<date>.json.
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
    from trtinfer.stage_weights import CHECKPOINT_COUNT
    from trtinfer.stages import graph_io

    st = read_stage(stage_dir, verify=False)
    # every graph measured here holds its weights in its own files
    view = StageDir(onnx_path.parent, {**st.info, "io": graph_io(onnx_path), CHECKPOINT_COUNT: 0})
    ids = held_out_ids(st.path / "tokenizer.json", tokens)
    with open_stage_session(view) as sess:
        return score_ids(sess, ids).perplexity


def chart(report: dict, path: Path) -> None:
    """Prefill and decode time per form (bars), perplexity x fp32 written above each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["rows"])
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, (key, label) in enumerate((("prefill_ms", "128-token prefill ms"), ("decode_ms", "decode step ms (x10)"))):
        values = [report["rows"][n][key] * (10 if key == "decode_ms" else 1) for n in names]
        bars = ax.bar([x + i * 0.4 for x in range(len(names))], values, 0.4, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    for x, n in enumerate(names):
        ratio = report["rows"][n].get("perplexity_vs_fp32")
        ax.annotate(f"ppl x{ratio:.3f}" if ratio else "ppl n/a", (x + 0.2, 0), xytext=(0, -28),
                    textcoords="offset points", ha="center", fontsize=7)
    ax.set_xticks([x + 0.2 for x in range(len(names))], [n.replace(" (", "\n(") for n in names], fontsize=6)
    ax.set_ylabel("ms")
    ax.set_title(f"weight forms, {report['model']} ({report['machine']['cpu']}, {report['machine']['cores']} cores)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    from trtinfer.stage_weights import materialized_file

    cfg = BuildConfig()
    exp = export_cached(resolve_model(args.model), cfg.export)
    opt = optimize_cached(exp, PassConfig(max_seq_len=cfg.max_seq_len_for(exp.geometry)))
    forms = []
    for name, qc in (("MatMulNBits 8-bit level 4 (trtinfer int8)", QuantConfig(precision="int8")),
                     ("MatMulNBits 4-bit block 32 (trtinfer int4 rtn)", QuantConfig(precision="int4", method="rtn")),
                     ("MatMulNBits 4-bit block 128 (int4 rtn --block-size 128)",
                      QuantConfig(precision="int4", method="rtn", block_size=128))):
        forms.append((name, quantize_cached(opt, qc, progress=False).onnx_path))
    rows = {}
    # the optimized stage reads its weights from the checkpoint: ONNX Runtime and quantize_dynamic need a whole copy
    with materialized_file(opt.onnx_path) as whole, tempfile.TemporaryDirectory() as tmp:
        forms = [("fp32", whole), *forms]
        for reduce in (True, False):
            dyn = Path(tmp) / f"rr{int(reduce)}" / "model.onnx"
            dyn.parent.mkdir()
            quantize_dynamic(str(whole), str(dyn), weight_type=QuantType.QInt8, per_channel=True,
                             reduce_range=reduce, op_types_to_quantize=["MatMul"], use_external_data_format=True)
            forms.append((f"DynamicQuantizeMatMul (quantize_dynamic{', reduce_range' if reduce else ''})", dyn))
        for name, path in forms:
            if not (path.parent / STAGE_FILE).exists():
                (path.parent / STAGE_FILE).write_text((opt.path / STAGE_FILE).read_text())
            t = timings(path)
            ppl = perplexity(opt.path, path)
            rows[name] = {**t, "perplexity": round(ppl, 4), "size_mib": round(sum(
                f.stat().st_size for f in path.parent.iterdir() if f.name.startswith(path.name)) / 2**20, 1)}
            print(f"{name:<44} prefill {t['prefill_ms']:7.1f} ms  decode {t['decode_ms']:6.2f} ms/step  "
                  f"ppl {ppl:.3f}", flush=True)
    base = rows["fp32"]["perplexity"]
    for r in rows.values():
        r["perplexity_vs_fp32"] = round(r["perplexity"] / base, 4) if math.isfinite(r["perplexity"]) else None
    report = {"machine": machine_info(), "model": args.model, "rows": rows}
    out = result_path("int8_forms")
    out.write_text(json.dumps(report, indent=2))
    chart(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
