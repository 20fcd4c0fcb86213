"""Real weights: SmolLM2-135M-Instruct and Gemma-3-270M, batched ragged greedy equal to transformers' generate.

Engines are built from the content-hash cache (~/.cache/trtinfer); from an empty cache each model is dequantized
and exported once (about 1.5 min for SmolLM2, 3 min for Gemma-3 on 2 cores).
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import trtinfer
from trtinfer.builder import build
from trtinfer.export import resolve_model

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma-3-270m"])
def real(request, real_engine, in_user_cache):
    name = request.param
    engine = real_engine(name)
    # The whole module builds in the user's cache (the fp16 test builds too): the dequantized model and its
    # export are what `trtinfer build NAME` reuses.
    with in_user_cache():
        src = resolve_model(name).path
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        yield name, engine, src, model


def hf_generate(model, ids, n):
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_batched_greedy_equals_hf_generate(real):
    name, engine, src, model = real
    tok = AutoTokenizer.from_pretrained(src)
    with trtinfer.load(engine) as eng:
        results = eng.generate(PROMPTS, max_new_tokens=16)
        for prompt, res in zip(PROMPTS, results):
            ids = tok(prompt).input_ids
            assert res.prompt_ids == ids
            assert res.token_ids == hf_generate(model, ids, 16), f"{name}: {prompt!r}"
            assert res.text == tok.decode(res.token_ids, skip_special_tokens=True)


def test_validation_recorded(real):
    _, engine, _, _ = real
    v = trtinfer.load(engine).manifest.raw["export"]["validation"]
    assert v["passed"] and v["decode_logits_max_abs_diff"] < 1e-3


def test_every_layer_fused_and_engine_checked(real, capsys):
    """`trtinfer inspect --json`: every attention, rotary, norm (and Gemma's GELUs) fused; engine check passed."""
    import json

    from trtinfer.cli import main

    name, engine, _, model = real
    assert main(["inspect", str(engine), "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    f, layers = m["fused_ops"], model.config.num_hidden_layers
    assert f["attention"]["count"] == f["attention"]["expected"] == layers  # SmolLM2: 30
    assert f["rotary"]["count"] == f["rotary"]["expected"] == 2 * layers
    assert f["norm"]["count"] >= f["norm"]["expected"] == m["geometry"]["num_norms"]  # SmolLM2: 61
    if name == "gemma-3-270m":
        assert f["gelu"]["count"] == f["gelu"]["expected"] == layers
    assert m["kv_layout"] == "shared_buffer" and not m["fusion_report"]["warnings"]
    assert m["engine_check"]["passed"] and m["engine_check"]["top1_agreement"] == 1.0


def test_gemma_prompt_beyond_sliding_window(real):
    """600-token prompt: 15 of Gemma-3's 18 layers must see only the last 512 positions, as transformers does."""
    name, engine, src, model = real
    if name != "gemma-3-270m":
        pytest.skip("sliding window is Gemma-3's")
    tok = AutoTokenizer.from_pretrained(src)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60))
    ids = tok(text).input_ids[:600]
    assert len(ids) == 600 and model.config.sliding_window == 512
    with trtinfer.load(engine) as eng:
        res = eng.generate(input_ids=[ids, ids[:40]], max_new_tokens=8)
    assert res[0].token_ids == hf_generate(model, ids, 8)
    assert res[1].token_ids == hf_generate(model, ids[:40], 8)


def test_chat_generation(real):
    """SmolLM2's GGUF carries its chat template; Gemma-3's does not, so it gets the built-in Gemma one."""
    _, engine, src, model = real
    tok = AutoTokenizer.from_pretrained(src)
    assert tok.chat_template is not None
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref_ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref_ids = list(ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids)
    with trtinfer.load(engine) as eng:
        assert eng.tokenizer.encode_chat(msgs) == ref_ids
        res = eng.generate(["What is the capital of France?"], chat=True, max_new_tokens=12)[0]
    assert res.token_ids == hf_generate(model, ref_ids, 12)


def test_fp16_engine_checks_on_cpu(real, tmp_path):
    """fp16 engines of the real models, run by ONNX Runtime's CPU kernels: the build's check against the export
    passes (SmolLM2 2.2e-3, Gemma-3 1.07e-2 relative) and greedy text equals the fp32 engine's on real prompts."""
    from trtinfer.builder import BuildConfig

    name, engine32, _, _ = real
    engine = build(name, tmp_path / "fp16", BuildConfig(precision="fp16"), progress=False)
    with trtinfer.load(engine) as eng:
        check = eng.manifest.raw["engine_check"]
        assert check["passed"] and check["top1_agreement"] == 1.0
        fp16 = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=8)]
    with trtinfer.load(engine32) as eng:
        fp32 = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=8)]
    assert fp16 == fp32
