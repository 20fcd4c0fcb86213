"""llama.cpp through llama-cpp-python on a GGUF file, batch 1 (its Python API generates one sequence at a time)."""
import os
import sys
import time

import llama_cpp
from llama_cpp import Llama

sys.path.insert(0, os.path.dirname(__file__))
from _timing import args, report

a = args()
if a.bs != 1:
    sys.exit("llama-cpp-python generates one sequence at a time: batch 1 only")
threads = len(os.sched_getaffinity(0))
llm = Llama(model_path=a.model, n_ctx=len(a.prompt) + a.new_tokens + 8, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False)


def gen(n):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(a.prompt)
    tok = llm.sample(top_k=1, temp=0.0)
    first = time.perf_counter() - t0
    out = [tok]
    for _ in range(n - 1):
        llm.eval([tok])
        tok = llm.sample(top_k=1, temp=0.0)
        out.append(tok)
    return first, time.perf_counter() - t0, out


report("llama.cpp", llama_cpp.__version__, a, gen, threads=threads)
