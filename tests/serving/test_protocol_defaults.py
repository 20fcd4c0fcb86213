"""Sampling defaults of the OpenAI server and the Triton model: the model's generation_config.json fields, not
transformers' own default top_k=50 (vLLM's rule)."""
from __future__ import annotations

import numpy as np

from trtinfer.runtime.config import GenerationConfig
from trtinfer.serving import protocol as P
from trtinfer.serving.triton import parse_request


def test_top_k_only_where_the_model_or_request_sets_it():
    defaults = GenerationConfig()  # top_k 50: transformers' default, not the model's
    req = P.CompletionRequest(prompt="hi", temperature=0.7)
    cfg = P.generation_config(req, defaults, prompt_len=2, max_seq_len=64, default_max_tokens=16)
    assert cfg.do_sample and cfg.top_k == 0
    model = GenerationConfig(top_k=20)
    cfg = P.generation_config(req, model, prompt_len=2, max_seq_len=64, default_max_tokens=16,
                              defaults_set=frozenset({"top_k"}))
    assert cfg.top_k == 20
    cfg = P.generation_config(P.CompletionRequest(prompt="hi", top_k=7), defaults, prompt_len=2, max_seq_len=64,
                              default_max_tokens=16)
    assert cfg.top_k == 7 and cfg.do_sample


def test_triton_requests_sample_like_the_server():
    text = np.array([b"hi"], dtype=object)
    r = parse_request({"text_input": text}, GenerationConfig(num_beams=2), frozenset({"num_beams"}))
    assert r.config.num_beams == 1 and not r.config.do_sample and r.config.top_k == 0  # one streamed sequence
    r = parse_request({"text_input": text, "top_p": np.array([0.9], np.float32)})
    assert r.config.do_sample and r.config.top_p == np.float32(0.9)
