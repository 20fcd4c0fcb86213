"""trtinfer.bench measures every system on the same work: the engine decodes greedily, as eager and the peers do,
even where the model's generation_config.json samples (Llama-3.2's and Qwen3's do)."""
from __future__ import annotations

import json
import shutil

import trtinfer
from trtinfer.bench import PROMPT_TEXT, run_engine


def test_the_engine_is_measured_greedy_whatever_the_model_samples(tiny_engine, tmp_path):
    engine = shutil.copytree(tiny_engine("llama"), tmp_path / "engine")
    (engine / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.5}))
    with trtinfer.load(engine) as eng:
        assert eng.generation_defaults.do_sample  # the model's defaults sample
        ids = eng.tokenizer.encode(PROMPT_TEXT)[:8]  # the benchmark's prompt
        greedy = eng.generate(input_ids=[ids], max_new_tokens=6, ignore_eos=True, do_sample=False)[0].token_ids
    runs = [run_engine(engine, 2, 8, 6, repeats=1).first_tokens for _ in range(2)]
    assert runs[0] == runs[1] == greedy


def test_an_engine_run_says_how_much_memory_sits_on_huge_pages(tiny_engine):
    """A decode rate depends on whether the packed weights went onto 2 MiB pages; every CPU run records it."""
    from trtinfer.runtime.memory import proc_kib

    res = run_engine(tiny_engine("llama"), 1, 8, 4, repeats=1)
    assert res.anon_rss_mib is not None and res.anon_huge_mib is not None
    assert 0 < res.anon_rss_mib and 0 <= res.anon_huge_mib <= res.anon_rss_mib
    now = proc_kib("/proc/self/smaps_rollup", "Anonymous")  # this process after the run: the same order of size
    assert now is not None and res.anon_rss_mib <= 2 * now / 1024
    assert {"anon_rss_mib", "anon_huge_mib"} <= res.to_dict().keys()
