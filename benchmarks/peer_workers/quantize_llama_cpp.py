"""llama.cpp's ``llama_model_quantize`` (through llama-cpp-python) from a bf16/f16 (or Q8_0: requantized) GGUF to TYPE
(Q4_0, Q4_K_M, ...).

usage: python quantize_llama_cpp.py IN.gguf OUT.gguf TYPE    (run with the interpreter of a venv holding llama_cpp)
"""
import ctypes
import os
import sys

import llama_cpp

src, dst, kind = sys.argv[1:4]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
params.nthread = len(os.sched_getaffinity(0))
params.allow_requantize = True  # a Q8_0 source (real_size.py --llama-cpp-outtype q8_0); no effect on bf16
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
if rc != 0:
    sys.exit(f"llama_model_quantize returned {rc}")
print(llama_cpp.__version__)
