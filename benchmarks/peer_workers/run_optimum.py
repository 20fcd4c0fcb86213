"""optimum-onnx's ORTModelForCausalLM on its own ONNX export (run with the interpreter of a venv holding optimum-onnx)."""
import os
import sys
import time

import optimum.onnxruntime
import torch
from optimum.onnxruntime import ORTModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
from _timing import args, report

a = args()
model = ORTModelForCausalLM.from_pretrained(a.model)
ids = torch.tensor([a.prompt] * a.bs)
mask = torch.ones_like(ids)


def gen(n):
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        return None, time.perf_counter() - t0, out[0, len(a.prompt):].tolist()


version = getattr(optimum.onnxruntime, "__version__", None)
if version is None:
    from importlib.metadata import version as _v
    version = _v("optimum-onnx")
report("optimum-onnx", version, a, gen)
