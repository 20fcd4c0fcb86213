"""llama.cpp's own ``convert_hf_to_gguf.py`` (from llama-cpp-python's source distribution: ``vendor/llama.cpp``), told
that a tokenizer trained with ``tokenizers`` (``make_checkpoint.py``'s) splits text as GPT-2's byte-level BPE does.

Its pre-tokenizer detection hashes a test string's tokenization against the hub tokenizers it knows; a tokenizer
made here is none of them. Everything else, the weights included, is converted by llama.cpp's code unchanged.

usage: python convert_llama_cpp.py PATH/convert_hf_to_gguf.py CHECKPOINT --outtype bf16 --outfile OUT.gguf
(needs torch, transformers, sentencepiece and numpy; the script's own ``gguf-py`` is put first on the path)
"""
import runpy
import sys
from pathlib import Path

script = Path(sys.argv[1]).resolve()
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
from conversion import base

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = sys.argv[1:]
runpy.run_path(str(script), run_name="__main__")
