"""The OpenAI-compatible server, live on loopback, through the real ``openai`` client (and httpx for raw HTTP).

Every answer is compared with ``engine.generate`` of the same prompt alone: concurrent ragged requests, streamed
and whole answers, seeded samples, stop strings, logprobs. Refusals are 4xx with OpenAI's error body, and the server
keeps serving after them; a client that leaves mid-stream frees its slot.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import uvicorn

import trtinfer
from trtinfer.errors import ConfigError
from trtinfer.serving import app as app_module
from trtinfer.serving.app import create_app
from trtinfer.serving.config import ServeConfig

KEY = "sk-test-key"
MODEL = "tiny-llama"
PROMPTS = ["The history of the city", "A quick brown fox jumps over the lazy dog while the cat", "Hello",
           "Machine learning models are exported to ONNX and run with ONNX Runtime on the CPU. Numbers 0123",
           "The", "Paris begins in antiquity, when a Celtic tribe settled", "punctuation: commas", "world! Numbers"]


class Live:
    """A uvicorn server on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    log_config=None, timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def service(self) -> Any:
        return self.app.state.service

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def live(engine_dir) -> Iterator[Live]:
    server = Live(create_app(engine_dir, ServeConfig(port=0, api_key=KEY, model_name=MODEL,
                                                     max_body_bytes=64 * 1024)))
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def greedy(ref, prompt: Any, n: int, chat: bool = False, **kw: Any) -> Any:
    return ref.generate([prompt], chat=chat, max_new_tokens=n, do_sample=False, **kw)[0]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def slow_decode(live) -> Iterator[Callable[[float], None]]:
    """``slow_decode(seconds)``: every decode step of the live server's scheduler takes at least that long."""
    cache = live.service.scheduler.cache
    original = cache.decode

    def set_delay(seconds: float) -> None:
        def decode(*a: Any, **kw: Any) -> Any:
            time.sleep(seconds)
            return original(*a, **kw)

        cache.decode = decode

    yield set_delay
    cache.decode = original


# ------------------------------------------------------------------------------------------------------------------
# configuration


def test_serve_config_checks():
    assert ServeConfig().host == "127.0.0.1" and ServeConfig().port == 8000 and ServeConfig().api_key is None
    for bad in ({"port": 70000}, {"port": -1}, {"max_queue": 0}, {"max_body_bytes": 0}, {"api_key": ""},
                {"provider": "tpu"}, {"host": ""}, {"prefill_chunk": True}):
        with pytest.raises(ConfigError) as e:
            ServeConfig(**bad)
        assert e.value.field == next(iter(bad))
    assert ServeConfig(provider="cuda").runtime().provider == "cuda"


def test_serving_imports_no_torch():
    code = ("import sys, trtinfer.serving.app, trtinfer.cli.serve; "
            "bad = [m for m in ('torch', 'transformers', 'onnx') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------------------------
# answers equal engine.generate alone


def test_models_and_health(live, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{live.url}/health").status_code == 200  # no key needed


def test_model_retrieve(live, client):
    m = client.models.retrieve(MODEL)
    listed = client.models.list().data[0]
    assert (m.id, m.object, m.owned_by, m.created) == (MODEL, "model", "trtinfer", listed.created)
    assert 0 < m.created <= time.time()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.status_code == 404
    assert (e.value.body["param"], e.value.body["code"]) == ("model", "model_not_found")
    assert "'gpt-4o'" in e.value.body["message"]
    err = error_of(httpx.get(f"{live.url}/v1/models/org/other", headers=auth()), 404, "model")  # a name with a slash
    assert "'org/other'" in err["message"] and err["type"] == "not_found_error"


def test_completion_equals_generate(client, ref):
    for prompt in PROMPTS[:3]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        want = greedy(ref, prompt, 12)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(ref.tokenizer.encode(prompt))
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.object == "text_completion" and r.model == MODEL


def test_completion_default_max_tokens_is_16(client, ref):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_completion_token_ids_and_batch(client, ref):
    ids = ref.tokenizer.encode(PROMPTS[1])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy(ref, PROMPTS[1], 8).text
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [greedy(ref, p, 6).text for p in PROMPTS[:3]]


def test_chat_equals_generate(client, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    want = greedy(ref, messages, 10, chat=True)
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.tokenizer.encode_chat(messages))
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.object == "chat.completion"


def test_chat_default_max_tokens_fills_the_context(client, ref):
    messages = [{"role": "user", "content": "The"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == ref.manifest.max_seq_len


def test_stream_equals_whole(client):
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 14, "temperature": 0}
    whole = client.completions.create(prompt=PROMPTS[0], **kw)
    chunks = list(client.completions.create(prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": PROMPTS[1]}]
    whole_chat = client.chat.completions.create(messages=messages, **kw)
    chunks_chat = list(client.chat.completions.create(messages=messages, stream=True,
                                                      stream_options={"include_usage": True}, **kw))
    assert chunks_chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks_chat if c.choices) == \
        whole_chat.choices[0].message.content
    assert chunks_chat[-1].usage == whole_chat.usage
    plain = list(client.chat.completions.create(messages=messages, stream=True, **kw))  # no usage chunk asked
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(client, chat):
    """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far; the last with choices the final one."""
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 9, "temperature": 0, "extra_body": {"ignore_eos": True}}
    create = client.chat.completions.create if chat else client.completions.create
    kw.update({"messages": [{"role": "user", "content": PROMPTS[1]}]} if chat else {"prompt": PROMPTS[1]})
    whole = create(**kw)
    chunks = list(create(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
    assert all(c.usage is not None for c in chunks)
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens and
               c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    so_far = [c.usage.completion_tokens for c in with_choices]
    # a chunk per token, whether its text shows yet or not (the random model's tokens include text-less ones)
    assert so_far == list(range(0 if chat else 1, 10)), so_far
    assert with_choices[-1].usage == chunks[-1].usage == whole.usage and whole.usage.completion_tokens == 9
    assert chunks[-1].choices == []
    # without include_usage it is ignored, as vLLM does
    plain = list(create(stream=True, stream_options={"continuous_usage_stats": True}, **kw))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_stream_ends_with_done(live):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=auth()) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


def test_concurrent_ragged_requests_equal_each_alone(client, ref):
    """Ragged prompts at once (chat and completions, whole and streamed) = greedy of each prompt alone."""
    def ask(i: int) -> tuple[str, str]:
        prompt, n = PROMPTS[i % len(PROMPTS)], 6 + 3 * (i % 5)
        if i % 2:
            messages = [{"role": "user", "content": prompt}]
            want = greedy(ref, messages, n, chat=True).text
            if i % 4 == 1:
                got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0)
                return got.choices[0].message.content or "", want
            stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, temperature=0,
                                                    stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream), want
        want = greedy(ref, prompt, n).text
        if i % 4 == 0:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0).choices[0].text, \
                want
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream), want

    with ThreadPoolExecutor(16) as pool:
        for got, want in pool.map(ask, range(24)):
            assert got == want


def test_n_and_seed(client, ref):
    """n choices with a seed: choice i is ``generate`` seeded ``seed + i``; the same request gives the same."""
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0.9, "seed": 7}
    first = client.completions.create(n=3, **kw)
    again = client.completions.create(n=3, **kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    for i, c in enumerate(first.choices):
        # top_k=0: the server applies no top-k the model's file does not set (vLLM's rule)
        want = ref.generate([PROMPTS[0]], max_new_tokens=10, do_sample=True, temperature=0.9, top_k=0, seed=7 + i)[0]
        assert c.text == want.text
    streamed = client.completions.create(n=3, stream=True, **kw)
    texts = ["", "", ""]
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in first.choices]
    assert first.usage.completion_tokens == sum(len(ref.generate([PROMPTS[0]], max_new_tokens=10, do_sample=True,
                                                                  temperature=0.9, top_k=0, seed=7 + i)[0].token_ids)
                                                for i in range(3))
    two = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, n=2)
    assert two.choices[0].text == two.choices[1].text == greedy(ref, PROMPTS[0], 6).text


def test_beam_search(client, ref):
    """vLLM's use_beam_search: n beams, every one a choice, best first: engine.generate(num_beams=n)'s hypotheses,
    also with a length penalty and for a batch of prompts; beside plain requests on the same scheduler."""
    for body, want_kw in [({}, {}), ({"length_penalty": 0.5, "early_stopping": True},
                                     {"length_penalty": 0.5, "early_stopping": True})]:
        got = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, n=3,
                                        extra_body={"use_beam_search": True, **body})
        want = ref.generate(PROMPTS[:2], max_new_tokens=8, num_beams=3, num_return_sequences=3, do_sample=False,
                            **want_kw)
        assert [c.index for c in got.choices] == list(range(6))
        assert [c.text for c in got.choices] == [r.text for r in want]
        assert [c.finish_reason for c in got.choices] == [r.finish_reason for r in want]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=6, n=2, extra_body={"use_beam_search": True})
    beams = ref.generate([PROMPTS[0]], chat=True, max_new_tokens=6, num_beams=2, num_return_sequences=2,
                         do_sample=False)
    assert [c.message.content for c in chat.choices] == [r.text for r in beams]
    one = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, n=1, temperature=0.8,
                                    extra_body={"use_beam_search": True})
    assert one.choices[0].text == greedy(ref, PROMPTS[0], 6).text  # a beam width of 1 is greedy


@pytest.mark.parametrize(("body", "param"), [({"stream": True}, "stream"), ({"stop": ["x"]}, "stop"),
                                             ({"logprobs": 2}, "logprobs"),
                                             ({"response_format": {"type": "json_object"}}, "response_format")])
def test_beam_search_refusals(live, body, param):
    request = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": True, **body}
    error_of(httpx.post(f"{live.url}/v1/completions", json=request, headers=auth()), 400, param)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
            "use_beam_search": True, "tools": [{"type": "function", "function": {"name": "f"}}]}
    error_of(httpx.post(f"{live.url}/v1/chat/completions", json=chat, headers=auth()), 400, "tools")


def test_sampling_extras_reach_the_generator(client, ref):
    """vLLM's extra body parameters (top_k, min_tokens, repetition_penalty, ignore_eos) and penalties."""
    kw = {"top_k": 5, "repetition_penalty": 1.3, "min_tokens": 4}
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=9, temperature=0.8, seed=3, top_p=0.9,
                                  presence_penalty=0.5, frequency_penalty=0.25, extra_body=kw)
    want = ref.generate([PROMPTS[2]], max_new_tokens=9, do_sample=True, temperature=0.8, seed=3, top_p=0.9, top_k=5,
                        repetition_penalty=1.3, min_new_tokens=4, presence_penalty=0.5, frequency_penalty=0.25)[0]
    assert r.choices[0].text == want.text


def test_stop_strings(client, ref):
    full = greedy(ref, PROMPTS[3], 24, ignore_eos=True)
    stop = next(full.text[i:i + 2] for i in range(4, len(full.text) - 2) if full.text[i:i + 2].isalnum())
    want = greedy(ref, PROMPTS[3], 24, ignore_eos=True, stop=[stop])
    assert want.finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == stop
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                            stop=[stop, "zzzz"], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_logprobs(client, ref):
    want = greedy(ref, PROMPTS[0], 6, logprobs=True, top_logprobs=2)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == \
        r.usage.completion_tokens == len(want.token_ids)
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    # the legacy format keys alternatives by their text: two tokens of the same text (say U+FFFD) make one entry
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert [max(top.values()) for top in lp.top_logprobs] == pytest.approx([x.top[0][1] for x in want.logprobs],
                                                                           abs=1e-4)
    assert lp.tokens == [ref.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]

    messages = [{"role": "user", "content": "Hello"}]
    want = greedy(ref, messages, 5, chat=True, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [x for ch in stream if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert [x.logprob for x in streamed] == pytest.approx([c.logprob for c in content])
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_metrics_move(live, client):
    before = httpx.get(f"{live.url}/metrics", headers=auth()).text
    for name in ("trtinfer:num_requests_running", "trtinfer:num_requests_waiting", "trtinfer:kv_cache_usage_perc",
                 "trtinfer:prompt_tokens_total", "trtinfer:generation_tokens_total",
                 "trtinfer:time_to_first_token_seconds_bucket", "trtinfer:inter_token_latency_seconds_bucket",
                 "trtinfer:e2e_request_latency_seconds_bucket", "trtinfer:request_success_total",
                 "trtinfer:prefix_cache_queries_total", "trtinfer:prefix_cache_hits_total"):
        assert name in before, name
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = httpx.get(f"{live.url}/metrics", headers=auth()).text
    moved = {name: metric(after, name) - metric(before, name) for name in (
        "trtinfer:prompt_tokens_total", "trtinfer:generation_tokens_total", "trtinfer:time_to_first_token_seconds_count",
        "trtinfer:inter_token_latency_seconds_count", "trtinfer:e2e_request_latency_seconds_count")}
    assert moved == {"trtinfer:prompt_tokens_total": r.usage.prompt_tokens, "trtinfer:generation_tokens_total": 7,
                     "trtinfer:time_to_first_token_seconds_count": 1, "trtinfer:inter_token_latency_seconds_count": 6,
                     "trtinfer:e2e_request_latency_seconds_count": 1}
    assert metric(after, "trtinfer:request_success_total", finished_reason="length") == \
        metric(before, "trtinfer:request_success_total", finished_reason="length") + 1
    assert metric(after, "trtinfer:num_requests_running") == 0


def test_a_beam_search_request_counts_once(live, client):
    """Each beam step is a request of the scheduler: one use_beam_search request moved request_success by 11, the
    latency histograms by 11 and prompt_tokens by 85 (a few-token prompt)."""
    before = httpx.get(f"{live.url}/metrics", headers=auth()).text
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, n=2, temperature=0,
                                  extra_body={"use_beam_search": True})
    after = httpx.get(f"{live.url}/metrics", headers=auth()).text
    moved = {name: metric_total(after, name) - metric_total(before, name) for name in (
        "trtinfer:request_success_total", "trtinfer:e2e_request_latency_seconds_count",
        "trtinfer:time_to_first_token_seconds_count", "trtinfer:prompt_tokens_total")}
    assert moved == {"trtinfer:request_success_total": 1, "trtinfer:e2e_request_latency_seconds_count": 1,
                     "trtinfer:time_to_first_token_seconds_count": 1,
                     "trtinfer:prompt_tokens_total": r.usage.prompt_tokens}


def metric_total(text: str, name: str) -> float:
    """The sum of a metric's samples over all its labels."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def test_success_and_latency_count_the_same_requests(live, client, slow_decode):
    """request_success (over its reasons) and the e2e histogram move together: finished and cancelled requests,
    streamed or whole, n > 1, submitted around the app; a refused request moves neither."""
    service = live.service

    def counted() -> int:
        return sum(n for reason, n in service.stats()["requests_finished"].items() if reason != "error")

    before, start = httpx.get(f"{live.url}/metrics", headers=auth()).text, counted()
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0, n=2)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=-1)
    cfg = dataclasses.replace(service.engine.generation_defaults, max_new_tokens=3)
    service.scheduler.submit(service.engine.tokenizer.encode("Hello"), cfg).result(timeout=30)  # not through a route
    slow_decode(0.01)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=auth()) as r:
        assert next(r.iter_lines()).startswith("data: ")  # then the client leaves: abort
    deadline = time.monotonic() + 10
    while counted() < start + 6:
        assert time.monotonic() < deadline, service.stats()
        time.sleep(0.01)
    after = httpx.get(f"{live.url}/metrics", headers=auth()).text
    successes = metric_total(after, "trtinfer:request_success_total") - \
        metric_total(before, "trtinfer:request_success_total")
    observed = metric(after, "trtinfer:e2e_request_latency_seconds_count") - \
        metric(before, "trtinfer:e2e_request_latency_seconds_count")
    assert successes == observed == 6
    assert metric(after, "trtinfer:request_success_total", finished_reason="abort") == \
        metric(before, "trtinfer:request_success_total", finished_reason="abort") + 1


# ------------------------------------------------------------------------------------------------------------------
# refusals: 4xx with OpenAI's error body, and the server keeps serving


def error_of(r: httpx.Response, status: int, param: str | None = "?") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param != "?":
        assert err["param"] == param, err
    return err


def test_api_key(live, client):
    bad = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert e.value.status_code == 401
    for path in ("/v1/models", "/v1/models/" + MODEL, "/v1/nowhere", "/nowhere"):
        error_of(httpx.get(f"{live.url}{path}"), 401)
    assert error_of(httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "x"}),
                    401)["code"] == "invalid_api_key"
    assert httpx.get(f"{live.url}/health").status_code == 200
    scraped = httpx.get(f"{live.url}/metrics")  # open, as vLLM's: a Prometheus scraper sends no key
    assert scraped.status_code == 200 and "trtinfer:num_requests_running" in scraped.text


def test_body_too_large(live):
    body = json.dumps({"model": MODEL, "prompt": "x" * (70 * 1024), "max_tokens": 1})
    error_of(httpx.post(f"{live.url}/v1/completions", content=body, headers={**auth(), "content-type":
                                                                              "application/json"}), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit still holds
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192].encode()

    error_of(httpx.post(f"{live.url}/v1/completions", content=chunks(), headers={**auth(), "content-type":
                                                                                 "application/json"}), 413)


def test_bad_json(live):
    for content in (b'{"model": "tiny-llama", "prompt": ', b"\xff\xfe", b"[1, 2]", b""):
        err = error_of(httpx.post(f"{live.url}/v1/completions", content=content,
                                  headers={**auth(), "content-type": "application/json"}), 400)
        assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"temperature": -1}, 400, "temperature"),
    ({"temperature": float("nan")}, 400, "temperature"),  # not greedy: NaN compares below every bound
    ({"max_tokens": 10_000}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": "many"}, 400, "max_tokens"),
    ({"top_p": 2}, 400, "top_p"),
    ({"top_k": -5}, 400, "top_k"),
    ({"n": 0}, 400, "n"),
    ({"n": 99}, 400, "n"),
    ({"seed": -3}, 400, "seed"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ({"logprobs": 30}, 400, "logprobs"),
    ({"echo": True}, 400, "echo"),
    ({"best_of": 3}, 400, "best_of"),
    ({"logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"stop": [""]}, 400, "stop"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [5, 99999]}, 400, "prompt"),
    ({"prompt": "word " * 300}, 400, "prompt"),
    ({"prompt": None}, 400, "prompt"),
    ({"model": "gpt-4"}, 404, "model"),
    # JSON's true is not 1, nor "5" five (pydantic's lax mode took both): numbers and flags are strict
    ({"n": True}, 400, "n"),
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": [True, 5]}, 400, "prompt"),
    ({"stream": 1}, 400, "stream"),
    ({"temperature": "0.5"}, 400, "temperature"),
    ({"prompt": [[1]] * 1025, "n": 2}, 400, "prompt"),  # 2,050 sequences in one request
])
def test_bad_completion_parameters(live, body, status, param):
    request = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **body}
    body_text = json.dumps(request)  # NaN as JavaScript writes it (httpx's json= refuses it; servers get it)
    error_of(httpx.post(f"{live.url}/v1/completions", content=body_text,
                        headers={**auth(), "content-type": "application/json"}), status, param)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, None),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"use_beam_search": True, "n": 2, "stream": True}, "stream"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
])
def test_bad_chat_parameters(live, body, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **body}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=request, headers=auth())
    if param is None:  # a message without content is an empty message (as an assistant turn with tool calls)
        assert r.status_code == 200
        return
    error_of(r, 400, param)


def test_null_is_the_default(live):
    """OpenAI's API types its optional fields as nullable: an explicit null answers as the field left out."""
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None, "temperature": None,
             "stop": None, "seed": None, "min_tokens": None, "ignore_eos": None, "use_beam_search": None}
    for route, body, extra in (
            ("completions", {"prompt": "Hello", "max_tokens": 4}, {"echo": None, "logprobs": None}),
            ("chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
             {"logprobs": None, "top_logprobs": None, "tools": None})):
        plain = httpx.post(f"{live.url}/v1/{route}", json={"model": MODEL, **body}, headers=auth())
        nulled = httpx.post(f"{live.url}/v1/{route}", json={"model": MODEL, **body, **nulls, **extra}, headers=auth())
        assert plain.status_code == nulled.status_code == 200, nulled.text
        assert [c.get("text", c.get("message")) for c in nulled.json()["choices"]] == \
            [c.get("text", c.get("message")) for c in plain.json()["choices"]]


def test_a_request_larger_than_the_queue_is_served_whole(live, client, ref):
    """A request's prompts x choices queue together: on an idle server any number of them is taken (were each
    checked against max_queue alone, n=3 with max_queue 1 would get 429 forever)."""
    scheduler = live.service.scheduler
    queue = scheduler.max_queue
    scheduler.max_queue = 1
    try:
        r = client.completions.create(model=MODEL, prompt=["Hello", "The sky"], n=3, max_tokens=4, temperature=0)
        assert len(r.choices) == 6 and sorted(c.index for c in r.choices) == list(range(6))
        for c in r.choices:  # greedy: each choice is its prompt's answer alone
            assert c.text == greedy(ref, ["Hello", "The sky"][c.index // 3], 4).text
    finally:
        scheduler.max_queue = queue


def test_unknown_role_is_refused(live, client):
    messages = [{"role": "user", "content": "Hello"}, {"role": "wizard", "content": "Hello"}]
    r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2},
                   headers=auth())
    err = error_of(r, 400, "messages.1.role")
    assert "wizard" in err["message"] and err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "narrator", "content": "hi"}], max_tokens=2)
    assert e.value.body["param"] == "messages.0.role" and "narrator" in e.value.body["message"]
    ok = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert client.chat.completions.create(model=MODEL, messages=ok, max_tokens=2).choices[0].message.role == \
        "assistant"


def test_bad_request_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_unknown_route_and_method(live):
    error_of(httpx.get(f"{live.url}/v1/nothing", headers=auth()), 404)
    error_of(httpx.get(f"{live.url}/v1/completions", headers=auth()), 405)


def test_queue_full_is_429(live, slow_decode):
    """Every slot busy and the queue full: 429; the held requests are cancelled after."""
    slow_decode(0.02)
    service = live.service
    scheduler = service.scheduler
    slots = scheduler.stats()["slots_total"]
    ids = service.engine.tokenizer.encode("Hello")
    cfg = dataclasses.replace(service.engine.generation_defaults, max_new_tokens=200, ignore_eos=True)
    queue = scheduler.max_queue
    held = [scheduler.submit(ids, cfg) for _ in range(slots)]
    try:
        deadline = time.monotonic() + 10
        while scheduler.stats()["running"] < slots:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        scheduler.max_queue = 1
        held.append(scheduler.submit(ids, cfg))  # waits: the queue is now full
        r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
                       headers=auth())
        assert error_of(r, 429)["type"] == "rate_limit_error"
        assert r.headers["Retry-After"] == str(app_module.RETRY_AFTER_S) and app_module.RETRY_AFTER_S >= 1
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           stream=True)
        assert int(e.value.response.headers["retry-after"]) == app_module.RETRY_AFTER_S
    finally:
        scheduler.max_queue = queue
        for h in held:
            h.cancel()
    for h in held:
        h.result(timeout=30)


def test_disconnect_mid_stream_frees_the_slot(live, slow_decode):
    slow_decode(0.01)
    service = live.service
    before = service.stats()["requests_finished"].get("cancelled", 0)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=auth()) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert service.stats()["running"] == 1
    # the connection is closed after a few of 200 tokens: the request is cancelled, its slot freed
    deadline = time.monotonic() + 5
    while service.stats()["running"] or service.stats()["waiting"]:
        assert time.monotonic() < deadline, service.stats()
        time.sleep(0.01)
    assert service.stats()["requests_finished"].get("cancelled", 0) == before + 1
    text = httpx.get(f"{live.url}/metrics", headers=auth()).text
    assert metric(text, "trtinfer:request_success_total", finished_reason="abort") == before + 1


def test_disconnect_while_waiting_for_a_whole_answer(live, slow_decode, caplog):
    slow_decode(0.01)
    service = live.service
    before = service.stats()["requests_finished"].get("cancelled", 0)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    with caplog.at_level(logging.ERROR, logger="trtinfer"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=body, headers=auth(), timeout=0.3)
        deadline = time.monotonic() + 5
        while service.stats()["running"]:
            assert time.monotonic() < deadline, service.stats()
            time.sleep(0.01)
        time.sleep(0.2)  # the handler finishes after the slot frees
    assert service.stats()["requests_finished"].get("cancelled", 0) == before + 1
    # the handler read the cancelled task's result once ("Result is not set": a logged 500 for every client that left)
    assert "request failed" not in caplog.text, caplog.text[-2000:]


def test_still_serving_after_all_that(live, client, ref):
    assert httpx.get(f"{live.url}/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert r.choices[0].text == greedy(ref, PROMPTS[0], 5).text
    stats = live.service.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["requests_finished"].get("error", 0) == 0


# ------------------------------------------------------------------------------------------------------------------
# loading


def test_health_503_while_loading(engine_dir, monkeypatch):
    gate = threading.Event()
    real = app_module.load_engine

    def held_back(*a: Any) -> Any:
        gate.wait(30)
        return real(*a)

    monkeypatch.setattr(app_module, "load_engine", held_back)
    server = Live(create_app(engine_dir, ServeConfig(port=0)))
    try:
        err = error_of(httpx.get(f"{server.url}/health"), 503)
        assert err["code"] == "model_not_ready"
        error_of(httpx.get(f"{server.url}/v1/models"), 503)
        error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}), 503)
        assert b"trtinfer:num_requests_running" in httpx.get(f"{server.url}/metrics").content
        gate.set()
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].id == "engine"  # the directory's name
        assert client.completions.create(model="engine", prompt="Hello", max_tokens=2).usage.completion_tokens <= 2
    finally:
        gate.set()
        server.stop()


def test_failed_load_is_reported(tmp_path, monkeypatch):
    def broken(*a: Any) -> Any:
        raise trtinfer.errors.EngineLoadError("no such engine")

    monkeypatch.setattr(app_module, "load_engine", broken)
    app = create_app(tmp_path, ServeConfig(port=0))
    failures: list[BaseException] = []
    app.state.service.on_failure.append(failures.append)
    server = Live(app)
    try:
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "no such engine" in error_of(httpx.get(f"{server.url}/health"), 503)["message"]
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------------------------
# the CLI verb


def served_url(proc: subprocess.Popen[str]) -> str:
    """The base URL a `trtinfer serve` process prints on its first stderr line, once /health answers 200."""
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
    assert m, line
    url = f"http://127.0.0.1:{m.group(1)}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return url
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline, "the server did not become ready in 60 s"
        time.sleep(0.05)


def test_cli_serve(engine_dir):
    env = {**os.environ, "TRTINFER_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "trtinfer.cli", "serve", str(engine_dir), "--port", "0",
                             "--model-name", MODEL], stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = served_url(proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3).object == "text_completion"
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from $TRTINFER_API_KEY
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "stopped" in rest and "Traceback" not in rest


@pytest.mark.parametrize(("args", "words"), [
    (["serve", "/no/such/engine"], "does not exist"),
    (["serve", "ENGINE", "--port", "70000"], "--port must be within"),
    (["serve", "ENGINE", "--max-queue", "0"], "--max-queue must be"),
])
def test_cli_serve_refuses(engine_dir, args, words):
    args = [str(engine_dir) if a == "ENGINE" else a for a in args]
    r = subprocess.run([sys.executable, "-m", "trtinfer.cli", *args], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("trtinfer serve: error:"), r.stderr


def test_cli_serve_load_failure_is_said_once(engine_dir, tmp_path):
    """An engine that fails while the server loads it (a garbage graph): the one error line, not the server's log
    line and then the same error again."""
    import shutil

    broken = shutil.copytree(engine_dir, tmp_path / "broken")
    (broken / "model.onnx").write_bytes(b"not a graph")
    r = subprocess.run([sys.executable, "-m", "trtinfer.cli", "serve", str(broken), "--port", "0"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and lines[0].startswith("trtinfer serve: error:"), r.stderr


@pytest.mark.parametrize("flag, limit, words", [("--max-model-len", "max_seq_len", "max sequence length"),
                                                ("--max-slots", "max_batch_size", "max batch size")])
def test_cli_serve_refuses_more_than_the_engine_holds(engine_dir, flag, limit, words):
    """Asking for more positions or rows than the engine has is said, not clamped silently."""
    engine_limit = json.loads((engine_dir / "manifest.json").read_text())["limits"][limit]
    r = subprocess.run([sys.executable, "-m", "trtinfer.cli", "serve", str(engine_dir), "--port", "0", flag,
                        str(engine_limit + 1)], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()  # said before any port opened (no "serving ... at http://" first)
    assert len(lines) == 1 and f"{flag}) {engine_limit + 1} exceeds the engine's {words} {engine_limit}" in lines[0]


def test_cli_serve_port_in_use(engine_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "trtinfer.cli", "serve", str(engine_dir), "--port", str(port)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------------------------------
# a real model


@pytest.mark.slow
def test_smollm2_concurrent_chat_equals_each_alone(real_engine):
    engine_dir = real_engine("smollm2-135m")
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Hi",
                 "Explain in two sentences why the sky is blue, for a child who asked at breakfast.",
                 "List three prime numbers.", "def fibonacci(n):", "Translate 'good morning' into Spanish.",
                 "Summarize the plot of Romeo and Juliet in one paragraph, naming the families."]
    server = Live(create_app(engine_dir, ServeConfig(port=0)))
    try:
        server.wait_ready(120)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(q: str) -> str:
            r = client.chat.completions.create(model="engine", messages=[{"role": "user", "content": q}],
                                               max_tokens=24 + 4 * len(q) % 17, temperature=0)
            return r.choices[0].message.content or ""

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, questions))
        with trtinfer.load(engine_dir) as eng:
            want = [eng.generate([[{"role": "user", "content": q}]], chat=True, max_new_tokens=24 + 4 * len(q) % 17,
                                 do_sample=False)[0].text for q in questions]
        assert got == want
    finally:
        server.stop()


def test_a_bug_in_the_handler_is_one_logged_500_through_the_apps_middleware(tiny_engine, monkeypatch, caplog):
    """Starlette's catch-all answered a handler's bug outside the app's middleware (a Ray replica's 500 lost its
    x-trtinfer-replica header) and re-raised it, so uvicorn logged the traceback a second time. Fault injected: the
    prompt encoder raises."""
    from trtinfer.serving import handler as handler_module

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("injected fault")

    app = create_app(tiny_engine("llama"), ServeConfig(port=0, model_name=MODEL))

    class Stamp:  # an app middleware, as ray_app's _ReplicaHeader
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            async def stamped(message: Any) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"x-stamp", b"1")]}
                await send(message)
            await self.inner(scope, receive, stamped)

    app.add_middleware(Stamp)
    server = Live(app)
    server.wait_ready()
    try:
        monkeypatch.setattr(handler_module, "_encode", broken)
        caplog.set_level(logging.ERROR)
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert r.headers.get("x-stamp") == "1"
        failures = [rec for rec in caplog.records if "injected fault" in rec.getMessage() or
                    "Exception in ASGI application" in rec.getMessage()]
        assert len(failures) == 1 and failures[0].exc_info is not None
    finally:
        server.stop()


SLOW_SERVE = """
import sys, time
import trtinfer.cli.serve as serve
from trtinfer.runtime.slots import SlotCache
serve.SHUTDOWN_GRACE_S, serve.SHUTDOWN_MARGIN_S = 1.0, 3.0  # a short grace period, for the test's time
real = SlotCache.decode
def slow(self, *a, **k):  # latency injected: each decode step takes 0.2 s more
    time.sleep(0.2)
    return real(self, *a, **k)
SlotCache.decode = slow
from trtinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_requests_running_past_the_grace_period_end_cleanly_at_a_stop(engine_dir):
    """uvicorn cancelled requests still running 10 s after SIGTERM before the app's shutdown could end them: streams
    broke off mid-chunk (no error event, no [DONE]) and whole requests got a bare text 500."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SERVE, "serve", str(engine_dir), "--port", "0",
                             "--model-name", MODEL], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    results: dict[str, Any] = {}
    try:
        url = served_url(proc)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "ignore_eos": True}

        def whole() -> None:
            results["whole"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        def streamed() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                results["stream"] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # both running (100 steps take 20 s)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    whole_r = results["whole"]
    assert whole_r.status_code == 503 and whole_r.json()["error"]["message"], whole_r.text
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-3:]
    assert "Cancel" not in rest and "Traceback" not in rest


@pytest.mark.parametrize(("where", "key", "words"), [
    ("flag", "abc ", "--api-key must be printable ASCII without spaces"),
    ("flag", "clé", "--api-key must be printable ASCII"),
    ("env", " abc", "$TRTINFER_API_KEY must be printable ASCII"),
])
def test_cli_serve_refuses_a_key_clients_cannot_send(engine_dir, where, key, words):
    """A key with edge spaces (a keyfile's newline, a paste) or non-ASCII was accepted, but httpx/openai refuse to
    send such a header; a bad $TRTINFER_API_KEY was reported as --api-key, a flag never given."""
    args = [sys.executable, "-m", "trtinfer.cli", "serve", str(engine_dir), "--port", "0"]
    env = {k: v for k, v in os.environ.items() if k != "TRTINFER_API_KEY"}
    if where == "flag":
        args += ["--api-key", key]
    else:
        env["TRTINFER_API_KEY"] = key
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False, env=env)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr
