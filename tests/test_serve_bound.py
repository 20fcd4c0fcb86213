"""benchmarks/serve_bound.py's in-process side on a tiny engine: the server's scheduler, built from the same flags
``trtinfer serve`` reads, runs every request to its full length; the summary pairs each round's served and in-process
numbers (guidellm itself is not installed in the test environment: the served side runs in the benchmark)."""
from __future__ import annotations

from benchmarks import serve_bound


def test_in_process_runs_the_servers_scheduler_on_the_same_flags(tiny_engine):
    engine = tiny_engine("llama")
    assert serve_bound.serve_config(engine, ["--no-spinning", "--max-slots", "2"]).runtime().spinning is False
    report = serve_bound.in_process(engine, streams=3, requests=5, prompt_tokens=9, output_tokens=4,
                                    serve_args=["--max-slots", "2", "--no-spinning"])
    assert report["requests"] == 5
    assert report["output_tokens_per_s"] > 0 and report["ttft_p50_ms"] > 0
    # 5 requests x 4 tokens on 2 rows, a row making at most 2 tokens a step (its prefill's, then a decode's)
    assert report["steps"] >= 5
    assert report["output_tokens"] == 5 * 4  # every request ran to its length (ignore_eos)


def test_summary_pairs_rounds():
    runs = [{"engine": "/e/a", "side": side, "round": r, "output_tokens_per_s": tok, "ttft_p50_ms": 100.0}
            for r, (served, alone) in enumerate([(90.0, 100.0), (120.0, 150.0)], 1)
            for side, tok in (("served", served), ("in_process", alone))]
    s = serve_bound.summarize(runs)["/e/a"]
    assert s["served_tok_s"] == [90.0, 120.0] and s["in_process_tok_s"] == [100.0, 150.0]
    assert s["ratio_by_round"] == [0.9, 0.8]
    assert s["ratio_of_means"] == round(105 / 125, 3)


def test_openai_client_side_serves_every_request_to_its_length(tiny_engine):
    """``--client openai``: a real ``trtinfer serve`` on loopback, streamed by the openai package from several threads,
    the in-process side's prompts; each request's usage says it made every token asked for."""
    engine = tiny_engine("llama")
    report = serve_bound.openai_load(engine, streams=2, requests=3, prompt_tokens=9, output_tokens=4,
                                     serve_args=["--max-slots", "2"])
    assert report["requests"] == 3 and report["output_tokens"] == 12
    assert report["checks"]["all_output_tokens_exact"]
    assert report["output_tokens_per_s"] > 0 and report["ttft_p50_ms"] > 0
