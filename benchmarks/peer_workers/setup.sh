#!/bin/bash
# The peers' venvs for benchmarks/vs_peers.py, under ${1:-$HOME/.cache/trtinfer/peer-venvs}:
#   oga      onnxruntime-genai 0.18 on this environment's onnxruntime (a .pth to its packages; its builder uses our
#            torch/transformers/onnx)
#   optimum  optimum-onnx 0.1.0 (its own transformers < 4.58) on torch 2.13.0, the CPU wheel
#   lcpp     llama-cpp-python 0.3.36 (compiles llama.cpp for this CPU: ~10 min on 2 cores)
#   llama.cpp-src  vendor/llama.cpp of the same source distribution: convert_hf_to_gguf.py with its conversion/ and
#            gguf-py/ (real_size.py --llama-cpp-convert; it runs with this environment's torch/transformers and needs
#            sentencepiece here)
set -euo pipefail
D=${1:-$HOME/.cache/trtinfer/peer-venvs}
# run inside trtinfer's environment (the venv its README installs): oga and the converter borrow its packages
python -c "import onnxruntime, torch, transformers" 2>/dev/null || {
  echo "setup.sh: 'python' ($(command -v python)) lacks onnxruntime/torch/transformers: activate trtinfer's venv first" >&2
  exit 2; }
mkdir -p "$D"
# oga sees this environment's packages through a .pth file (--system-site-packages would show the base Python's, not
# this venv's: its builder then failed with "Could not find the onnxruntime package")
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
[ -x "$D/oga/bin/python" ] || { python -m venv "$D/oga" && purelib python > "$(purelib "$D/oga/bin/python")/trtinfer-env.pth" && "$D/oga/bin/pip" install -q --no-deps onnxruntime-genai==0.18.0; }
[ -x "$D/optimum/bin/optimum-cli" ] || { python -m venv "$D/optimum" && "$D/optimum/bin/pip" install -q torch==2.13.0 && "$D/optimum/bin/pip" install -q "optimum-onnx[onnxruntime]==0.1.0"; }
# -mno-amx-*: on a Sapphire Rapids VM that lists amx_tile/amx_int8 in /proc/cpuinfo, ggml's AMX kernels (compiled in by
# -march=native) died with SIGILL on their first tile instruction (tilezero); llama.cpp then runs its AVX-512 VNNI kernels
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
[ -x "$D/lcpp/bin/python" ] && "$D/lcpp/bin/python" -c "import llama_cpp" 2>/dev/null || { python -m venv "$D/lcpp" && CMAKE_ARGS="-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" "$D/lcpp/bin/pip" install -q --no-cache-dir llama-cpp-python==0.3.36; }
[ -f "$D/llama.cpp-src/convert_hf_to_gguf.py" ] || { pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$D/sdist" && mkdir -p "$D/llama.cpp-src" && tar xzf "$D"/sdist/llama_cpp_python-0.3.36.tar.gz -C "$D/llama.cpp-src" --strip-components=3 llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py llama_cpp_python-0.3.36/vendor/llama.cpp/conversion llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py; }
python -c "import sentencepiece" 2>/dev/null || pip install -q sentencepiece
echo "python -m benchmarks.real_size --preset llama-3.2-1b --oga-python $D/oga/bin/python --llama-cpp-python $D/lcpp/bin/python --llama-cpp-convert $D/llama.cpp-src/convert_hf_to_gguf.py"
echo "python -m benchmarks.vs_peers --oga-python $D/oga/bin/python --optimum-python $D/optimum/bin/python --llama-cpp-python $D/lcpp/bin/python"
