"""onnxruntime-genai on a model-builder output (run with the interpreter of a venv holding onnxruntime-genai)."""
import os
import sys
import time

import numpy as np
import onnxruntime_genai as og

sys.path.insert(0, os.path.dirname(__file__))
from _timing import args, report

a = args()
model = og.Model(a.model)
batch = np.array([a.prompt] * a.bs, dtype=np.int32)
n_prompt = len(a.prompt)


def gen(n):
    p = og.GeneratorParams(model)
    p.set_search_options(max_length=n_prompt + n, min_length=n_prompt + n, do_sample=False, batch_size=a.bs)
    g = og.Generator(model, p)
    t0 = time.perf_counter()
    g.append_tokens(batch)
    g.generate_next_token()
    first = time.perf_counter() - t0
    while not g.is_done():
        g.generate_next_token()
    return first, time.perf_counter() - t0, list(g.get_sequence(0)[n_prompt:])


report("onnxruntime-genai", og.__version__, a, gen)
