"""Perplexity of int4 fake-quantized weights (round-to-nearest vs GPTQ) on a real optimized fp32 decoder graph.

Calibration: the inputs of every MatMul with a constant weight, captured on windows of a calibration text run through
the fp32 graph, summed into Hessians. Evaluation: one window of a held-out text through a copy of the graph whose
LM head sees every position (the export computes logits at the last position only), with the quantized weights
written back as floats (session-level initializer overrides, so no 600 MB copies land on disk).

    python -m benchmarks.gptq_probe [STAGE_DIR] [--json out.json]
    python -m benchmarks.gptq_probe --timing     # GPTQ time on SmolLM2's shapes (random weights), numpy only
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.quantization.blocks import BlockWeight, quantize_rtn
from trtinfer.quantization.gptq import HessianAccumulator, gptq_quantize, weighted_error

CALIB_TEXT = Path("/usr/share/common-licenses/GFDL-1.3")
EVAL_TEXT = Path("/usr/share/common-licenses/GPL-3")
DTYPES = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16}


def find_stage(arch: str = "llama") -> Path:
    """The first cached optimized fp32 stage of ``arch``."""
    for d in sorted((Path.home() / ".cache/trtinfer/optimized").glob("*/")):
        st = json.loads((d / "stage.json").read_text())
        prec = st["history"].get("optimize", {}).get("config", {}).get("precision")
        if st.get("architecture") == arch and prec == "fp32":
            return d
    raise SystemExit(f"no optimized fp32 {arch} stage in ~/.cache/trtinfer/optimized")


def feeds(stage: dict, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs of a one-shot batch-1 prefill of ``ids`` into a zero shared KV buffer of exactly ``len(ids)``."""
    s = len(ids)
    out: dict[str, np.ndarray] = {}
    for spec in stage["io"]["inputs"]:
        name, dt = spec["name"], DTYPES[spec["dtype"]]
        if name == "input_ids":
            out[name] = ids[None, :].astype(dt)
        elif name == "seqlens_k":
            out[name] = np.array([s - 1], dt)
        elif name == "total_sequence_length":
            out[name] = np.array(s, dt)
        elif name.startswith("past_key_values."):
            shape = [1 if d == "batch" else s if d == "max_sequence" else d for d in spec["shape"]]
            out[name] = np.zeros(shape, dt)
        elif name == "logits_positions":
            out[name] = np.array([[s - 1]], dt)
        else:
            raise SystemExit(f"don't know how to feed graph input {name!r}")
    return out


def all_position_logits(model: Any) -> str:
    """Rewire the LM head MatMul onto the final norm's full output; returns the LM head weight's name."""
    head = next(n for n in model.graph.node if n.output and n.output[0] == "logits")
    src = head.input[0]
    # follow Unsqueeze/GatherND (the last-position selection) back to the final norm's output
    producers = {o: n for n in model.graph.node for o in n.output}
    while src in producers and producers[src].op_type in ("Unsqueeze", "GatherND", "Slice", "Gather", "Squeeze"):
        src = producers[src].input[0]
    head.input[0] = src
    return head.input[1]


def timing() -> None:
    """Seconds GPTQ takes on SmolLM2-135M's MatMul shapes: one layer (x30) and the 576 x 49152 LM head."""
    rng = np.random.default_rng(0)

    def hessian(k: int) -> np.ndarray:
        acc = HessianAccumulator(k)
        acc.add((rng.normal(size=(2048, k)) @ (rng.normal(size=(k, k)) / np.sqrt(k))).astype(np.float32))
        return acc.hessian()

    h576, h1536 = hessian(576), hessian(1536)
    layer = [(576, 576, h576), (576, 192, h576), (576, 192, h576), (576, 576, h576), (576, 1536, h576),
             (576, 1536, h576), (1536, 576, h1536)]
    for kw in ({}, {"scale_search": True}, {"act_order": True}):
        t0 = time.perf_counter()
        for k, n, h in layer:
            gptq_quantize(rng.normal(size=(k, n)).astype(np.float32), h, **kw)
        t_layer = time.perf_counter() - t0
        t0 = time.perf_counter()
        gptq_quantize(rng.normal(size=(576, 49152)).astype(np.float32), h576, **kw)
        t_head = time.perf_counter() - t0
        print(f"{kw}: layer {t_layer:.2f} s (x30 = {30 * t_layer:.1f} s), LM head {t_head:.2f} s, "
              f"model {30 * t_layer + t_head:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", nargs="?", type=Path)
    ap.add_argument("--arch", default="llama", help="architecture of the cached stage to use when STAGE is not given")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", nargs="*", default=[], help="run only the variants whose label contains one of these")
    ap.add_argument("--timing", action="store_true", help="only time GPTQ on SmolLM2's shapes")
    args = ap.parse_args()
    if args.timing:
        timing()
        return
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
    from tokenizers import Tokenizer

    stage_dir = args.stage or find_stage(args.arch)
    stage = json.loads((stage_dir / "stage.json").read_text())
    tok = Tokenizer.from_file(str(stage_dir / "tokenizer.json"))
    print(f"stage {stage_dir} ({stage['architecture']})", flush=True)

    model = onnx.load(str(stage_dir / "model.onnx"))
    head_weight = all_position_logits(model)
    inits = {i.name: i for i in model.graph.initializer}
    matmuls = [(n.input[0], n.input[1]) for n in model.graph.node
               if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]
    weights = {w: numpy_helper.to_array(inits[w]) for _, w in matmuls}
    acts = sorted({a for a, _ in matmuls})
    print(f"{len(matmuls)} MatMul weights, {len(acts)} distinct inputs", flush=True)

    # --- calibration: capture MatMul inputs ---------------------------------------------------------------------
    cal = onnx.ModelProto()
    cal.CopyFrom(model)
    known = {o.name for o in cal.graph.output}
    for a in acts:
        if a not in known:
            cal.graph.output.append(onnx.helper.make_empty_tensor_value_info(a))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep the captured tensors intact
    sess = ort.InferenceSession(cal.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del cal
    ids = np.array(tok.encode(CALIB_TEXT.read_text()).ids, np.int64)
    need = args.windows * args.window
    if len(ids) < need:
        raise SystemExit(f"calibration text has {len(ids)} tokens, need {need}")
    accs = {a: HessianAccumulator(int(weights[next(w for x, w in matmuls if x == a)].shape[0])) for a in acts}
    t0 = time.perf_counter()
    for i in range(args.windows):
        outs = sess.run(acts, feeds(stage, ids[i * args.window:(i + 1) * args.window]))
        for a, x in zip(acts, outs, strict=True):
            accs[a].add(x)
    del sess
    hess = {a: accs[a].hessian() for a in acts}
    print(f"captured {need} tokens in {time.perf_counter() - t0:.1f} s", flush=True)

    # --- evaluation --------------------------------------------------------------------------------------------
    eval_ids = np.array(tok.encode(EVAL_TEXT.read_text()).ids[:args.eval_tokens], np.int64)
    eval_bytes = model.SerializeToString()
    del model, inits  # the weights live on in `weights`; a 2 GB graph should not be held three times
    eval_feed = feeds(stage, eval_ids)

    def perplexity(overrides: dict[str, np.ndarray]) -> float:
        opts = ort.SessionOptions()
        vals = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in overrides.items()}
        for k, v in vals.items():
            opts.add_initializer(k, v)
        s = ort.InferenceSession(eval_bytes, opts, providers=["CPUExecutionProvider"])
        logits = s.run(["logits"], eval_feed)[0][0]
        del s
        nll = []
        for r in range(0, len(eval_ids) - 1, 128):  # by rows: a 262k vocabulary's float64 logits would not fit
            lg = logits[r:min(r + 128, len(eval_ids) - 1)].astype(np.float64)
            top = lg.max(-1)
            lse = np.log(np.exp(lg - top[:, None]).sum(-1)) + top
            nll.append(lse - lg[np.arange(len(lg)), eval_ids[r + 1:r + 1 + len(lg)]])
        return float(np.exp(np.concatenate(nll).mean()))

    base = perplexity({})
    print(f"fp32 perplexity {base:.3f} on {len(eval_ids)} tokens", flush=True)

    hess_of = {w: hess[a] for a, w in matmuls}
    cache: dict[tuple, tuple[np.ndarray, float]] = {}

    def quantized(name: str, method: str, bits: int, block: int, **kw: bool) -> np.ndarray:
        key = (name, method, bits, block, tuple(sorted(kw.items())))
        if key not in cache:
            w = weights[name]
            if method == "rtn":
                q: BlockWeight = quantize_rtn(w, bits, block)
            elif method == "rtn-search":  # GPTQ with H = I: round-to-nearest with each block's scale search
                q = gptq_quantize(w, np.eye(w.shape[0]), bits=bits, block=block, scale_search=True)
            else:
                q = gptq_quantize(w, hess_of[name], bits=bits, block=block, **kw)
            # the LM head's error costs a 576 x 576 x 49152 product and is not reported
            err = float("nan") if name == head_weight else weighted_error(w, q, hess_of[name])
            cache[key] = (q.dequantize(), err)
        return cache[key][0]

    Spec = tuple[str, int, int, dict]
    variants: dict[str, tuple[Spec, Spec | None]] = {
        "rtn b32, head int4": (("rtn", 4, 32, {}), ("rtn", 4, 32, {})),
        "rtn b32, head int8": (("rtn", 4, 32, {}), ("rtn", 8, 32, {})),
        "rtn b32, head fp32": (("rtn", 4, 32, {}), None),
        "gptq b32, head gptq int4": (("gptq", 4, 32, {}), ("gptq", 4, 32, {})),
        "gptq b32, head gptq int8": (("gptq", 4, 32, {}), ("gptq", 8, 32, {})),
        "gptq b32, head rtn int8": (("gptq", 4, 32, {}), ("rtn", 8, 32, {})),
        "gptq b32, head fp32": (("gptq", 4, 32, {}), None),
        "gptq b32 +search, head int8": (("gptq", 4, 32, {"scale_search": True}), ("gptq", 8, 32, {})),
        "gptq b32 +search, head int4 +search": (("gptq", 4, 32, {"scale_search": True}),
                                                ("gptq", 4, 32, {"scale_search": True})),
        "gptq b32 act-order, head int8": (("gptq", 4, 32, {"act_order": True}), ("gptq", 8, 32, {})),
        "gptq b32 act-order +search, head int8": (("gptq", 4, 32, {"act_order": True, "scale_search": True}),
                                                  ("gptq", 8, 32, {})),
        "gptq b64, head int8": (("gptq", 4, 64, {}), ("gptq", 8, 64, {})),
        "gptq b64 +search, head int8": (("gptq", 4, 64, {"scale_search": True}), ("gptq", 8, 64, {})),
        "gptq b32 act-order +search, head int4 act-order +search": (
            ("gptq", 4, 32, {"act_order": True, "scale_search": True}),
            ("gptq", 4, 32, {"act_order": True, "scale_search": True})),
        "rtn +search b32, head int8": (("rtn-search", 4, 32, {}), ("rtn", 8, 32, {})),
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in args.only)}
    rows = []
    for label, (body, head) in variants.items():
        t0 = time.perf_counter()
        over: dict[str, np.ndarray] = {}
        for _, w in matmuls:
            spec: Spec | None = head if w == head_weight else body
            if spec is not None:
                method, bits, block, kw = spec
                over[w] = quantized(w, method, bits, block, **kw)
        tq = time.perf_counter() - t0
        errs = [cache[k][1] for k in cache if k[0] != head_weight and k[1:4] == body[:3]
                and k[4] == tuple(sorted(body[3].items()))]
        ppl = perplexity(over)
        rows.append({"variant": label, "ppl": ppl, "ratio": ppl / base, "quantize_s": tq,
                     "mean_body_weighted_error": float(np.mean(errs)) if errs else None})
        print(f"{label:42s} ppl {ppl:8.3f}  x{ppl / base:.3f}  (quantize {tq:5.1f} s, body err "
              f"{rows[-1]['mean_body_weighted_error']:.4f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"stage": str(stage_dir), "fp32_ppl": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
