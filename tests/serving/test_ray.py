"""``trtinfer serve --ray``: the OpenAI server as a Ray Serve deployment, on a real local Ray instance.

One ``trtinfer serve ENGINE --ray --replicas 2`` process (a private local Ray instance, 2 CPUs, loopback only) serves
the tiny llama engine; the real ``openai`` client's completions, chats and streams equal ``engine.generate`` alone,
concurrent requests reach both replicas (the ``x-trtinfer-replica`` header), a refused request is a 4xx and the
deployment keeps serving, and Ctrl-C takes Ray down with exit status 0. Without Ray installed, importing
``ray_app`` and ``--ray`` each say what to install in one line.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from trtinfer.errors import ConfigError

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'trtinfer[ray]'")

from trtinfer.serving.ray_app import REPLICA_HEADER, RayConfig, max_ongoing

KEY = "sk-ray-key"
MODEL = "tiny-llama"
PROMPTS = ["The history of the city", "A quick brown fox jumps over the lazy dog while the cat", "Hello",
           "Machine learning models are exported to ONNX and run with ONNX Runtime on the CPU. Numbers 0123",
           "The", "Paris begins in antiquity, when a Celtic tribe settled", "punctuation: commas", "world! Numbers"]
#: Ray's start (~15 s), Serve's (~10 s) and two replicas loading, on a 2-core machine
START_TIMEOUT = 240


class RayServer:
    """``trtinfer serve ENGINE --ray --replicas 2`` in its own session; its output goes to a file (Ray is chatty)."""

    def __init__(self, engine_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        env = {**os.environ, "TRTINFER_API_KEY": KEY, "RAY_USAGE_STATS_ENABLED": "0"}
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trtinfer.cli", "serve", str(engine_dir), "--ray", "--replicas", "2",
                 "--port", "0", "--model-name", MODEL],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.t_start = time.monotonic()
        deadline = self.t_start + START_TIMEOUT
        while not (m := re.search(r"serving .* at (http://127\.0\.0\.1:\d+)/v1 on Ray Serve", self.output())):
            assert self.proc.poll() is None, f"trtinfer serve --ray exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"trtinfer serve --ray did not start:\n{self.output()[-4000:]}"
            time.sleep(0.2)
        self.url = m.group(1)
        self.startup_s = time.monotonic() - self.t_start

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 90, twice: bool = False) -> int:
        """Ctrl-C (``twice``: two in a row, as an impatient user or timeout(1) forwarding its own signal sends), then
        the exit status; the whole session is killed if it does not stop in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            if twice:
                time.sleep(0.05)
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory) -> Iterator[RayServer]:
    s = RayServer(engine_dir, tmp_path_factory.mktemp("ray") / "serve.log")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(ref, prompt: Any, n: int, chat: bool = False) -> Any:
    return ref.generate([prompt], chat=chat, max_new_tokens=n, do_sample=False)[0]


# ------------------------------------------------------------------------------------------------------------------
# configuration (no Ray started)


def test_ray_config_checks():
    assert RayConfig().replicas == 1 and RayConfig().replica_cpus == 1.0 and RayConfig().address is None
    for bad in ({"replicas": 0}, {"replicas": 1.5}, {"replica_cpus": 0}, {"replica_cpus": float("nan")},
                {"replica_cpus": True}, {"max_ongoing_requests": 0}, {"address": ""}, {"app_name": " "}):
        with pytest.raises(ConfigError) as e:
            RayConfig(**bad)
        assert e.value.field == next(iter(bad))


def test_max_ongoing_fills_the_batch_and_a_second():
    assert max_ongoing(16, 64) == 32  # the batch, plus as many queued in the scheduler
    assert max_ongoing(16, 4) == 20  # never past what the scheduler's queue takes (else 429s Ray could route)
    assert max_ongoing(1, 64) == 2


def _without_ray(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python where ``import ray`` fails as if Ray were not installed."""
    return subprocess.run([sys.executable, "-c", "import sys; sys.modules['ray'] = None\n" + code],
                          capture_output=True, text=True, timeout=120, check=False)


def test_import_without_ray_names_the_extra():
    r = _without_ray("import trtinfer.serving.ray_app")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == ('ModuleNotFoundError: trtinfer.serving.ray_app needs Ray Serve: '
                                                 'pip install "trtinfer[ray]"'), r.stderr


def test_cli_ray_without_ray_is_one_line_exit_2(engine_dir):
    r = _without_ray(f"from trtinfer.cli import main; sys.exit(main(['serve', {str(engine_dir)!r}, '--ray']))")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "trtinfer[ray]" in lines[0], r.stderr


@pytest.mark.parametrize(("args", "words"), [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--replicas", "0"], "--replicas must be an integer >= 1"),
    (["--ray", "--replica-cpus", "-1"], "--replica-cpus must be a number > 0"),
])
def test_cli_ray_flags_refused(engine_dir, args, words):
    r = subprocess.run([sys.executable, "-m", "trtinfer.cli", "serve", str(engine_dir), *args], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("trtinfer serve: error:"), r.stderr


# ------------------------------------------------------------------------------------------------------------------
# a real local Ray instance: two replicas behind Ray Serve's proxy


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_and_chat_equal_generate(client, ref):
    for prompt in PROMPTS[:3]:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        want = greedy(ref, prompt, 12)
        assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == greedy(ref, messages, 10, chat=True).text


def test_streams_equal_generate(client, ref):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=14, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy(ref, PROMPTS[1], 14).text
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason is not None
    messages = [{"role": "user", "content": "Tell me about Paris"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    want = greedy(ref, messages, 12, chat=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_concurrent_requests_reach_both_replicas(client, ref):
    def ask(i: int) -> tuple[str, str, bool]:
        prompt = PROMPTS[i % len(PROMPTS)]
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                           extra_body={"ignore_eos": True})
        return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text, i

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(24)))
    assert len({replica for replica, _, _ in answers}) == 2, answers
    for _, text, i in answers:
        prompt = PROMPTS[i % len(PROMPTS)]
        assert text == ref.generate([prompt], max_new_tokens=24, do_sample=False, ignore_eos=True)[0].text


def test_refusals_are_4xx_and_it_keeps_serving(server, client, ref):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1},
                   headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert REPLICA_HEADER in r.headers
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                   headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the key came from $TRTINFER_API_KEY
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert r.choices[0].text == greedy(ref, PROMPTS[0], 8).text


def test_ctrl_c_stops_ray_cleanly(server):
    # two signals in a row once deadlocked the shutdown (the handler took a lock the first handler held)
    assert server.stop(twice=True) == 0, server.output()[-4000:]
    out = server.output()
    assert "stopped" in out and "Traceback" not in out, out[-4000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
