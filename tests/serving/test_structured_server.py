"""Structured outputs through a live `trtinfer serve` and the real openai client: response_format json_schema (the
client's own ``parse`` with a pydantic model too), vLLM's guided_* extras, and 400s for bad formats."""
from __future__ import annotations

import json
from enum import Enum

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.runtime.test_structured import SCHEMA
from tests.serving.test_server import Live
from trtinfer.serving.app import create_app
from trtinfer.serving.config import ServeConfig


@pytest.fixture(scope="module")
def client(tiny_engine):
    server = Live(create_app(tiny_engine("llama"), ServeConfig(port=0, model_name="tiny")))
    server.wait_ready()
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    server.stop()


def test_chat_json_schema_parses(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Describe a thing."}],
                                       max_tokens=120, temperature=0.9, seed=1, n=2, response_format=fmt)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


class Color(str, Enum):
    red = "red"
    green = "green"


class Pick(pydantic.BaseModel):
    color: Color
    size: int = pydantic.Field(ge=0, le=99)
    ok: bool


def test_openai_parse_with_a_pydantic_model(client):
    """The client's own structured-output helper: it sends a strict json_schema and parses the answer back."""
    r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "Pick one."}],
                                      max_tokens=60, response_format=Pick)
    assert isinstance(r.choices[0].message.parsed, Pick)


def test_streamed_guided_json_and_completions_extras(client):
    parts = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="A thing:", max_tokens=120, stream=True, extra_body={"guided_json": SCHEMA})
        if c.choices]
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)
    r = client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model="tiny", prompt="A date:", max_tokens=16,
                                  extra_body={"guided_regex": "20[0-9]{2}-[01][0-9]"})
    assert len(r.choices[0].text) == 7 and r.choices[0].text.startswith("20")


@pytest.mark.parametrize(("extra", "says", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format is not a usable grammar: .*nonsense", "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be one of", "response_format"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "not several", "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json must be a JSON schema", "guided_json"),
    ({"guided_regex": "("}, "guided_regex is not a usable grammar", "guided_regex"),  # the field the client wrote
])
def test_bad_formats_are_400(client, extra, says, param):
    with pytest.raises(openai.BadRequestError, match=says) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param


@pytest.mark.parametrize(("extra", "param"), [
    ('"guided_regex": "(\\ud800"', "guided_regex"),
    ('"guided_grammar": "start: \\"a\\ud800\\""', "guided_grammar"),
    ('"response_format": {"type": "regex", "regex": "a\\ud800"}', "response_format"),
    ('"guided_json": {"type": "string", "pattern": "\\ud800"}', "guided_json"),
    ('"guided_choice": []', "guided_choice"),
])
def test_formats_with_lone_surrogates_or_empty_are_400_naming_their_field(client, extra, param):
    """A lone surrogate (JSON's \\ud800, which the openai client cannot even send) in a pattern reached the grammar
    compiler and came back a 500; an empty guided_choice was reported under response_format."""
    body = '{"model": "tiny", "prompt": "x", "max_tokens": 2, ' + extra + "}"
    r = httpx.post(f"{client.base_url}completions", content=body.encode(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_logprobs_with_a_response_format(client):
    """logprobs were dropped (null) whenever the chat request also asked for a structured output."""
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=2, response_format={"type": "json_object"})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_langchain_with_structured_output(client):
    """langchain-openai's with_structured_output (json_schema method) against the live server: a Pick back."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=str(client.base_url), api_key="none", max_tokens=60, temperature=0,
                     max_retries=0)
    got = llm.with_structured_output(Pick, method="json_schema").invoke("Pick one.")
    assert isinstance(got, Pick)


@pytest.mark.slow
def test_smollm2_instruct_json_schema_and_langchain(real_engine):
    """SmolLM2-135M-Instruct behind a live server: the openai client's json_schema answer parses and validates, and
    langchain-openai's with_structured_output returns the pydantic object."""
    from langchain_openai import ChatOpenAI

    server = Live(create_app(real_engine("smollm2-135m"), ServeConfig(port=0, model_name="smol")))
    server.wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
        fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
        r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Describe a cat."}],
                                           max_tokens=200, temperature=0.7, seed=3, response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        llm = ChatOpenAI(model="smol", base_url=f"{server.url}/v1", api_key="none", max_tokens=80, temperature=0,
                         max_retries=0)
        got = llm.with_structured_output(Pick, method="json_schema").invoke("Pick a color, a size and whether ok.")
        assert isinstance(got, Pick)
    finally:
        server.stop()


def test_grammars_compile_off_the_event_loop(tiny_engine, monkeypatch):
    """submit_all (which compiles a response_format's grammar, and makes the tokenizer's llguidance form on first
    use) ran on the server's event loop, stalling every other stream meanwhile."""
    import asyncio

    from trtinfer.runtime.scheduler import Scheduler

    on_loop: list[bool] = []
    real = Scheduler.submit_all

    def spy(self, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "submit_all", spy)
    server = Live(create_app(tiny_engine("llama"), ServeConfig(port=0, model_name="tiny")))
    server.wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt="A date:", max_tokens=8,
                                      extra_body={"guided_regex": "20[0-9]{2}"})
        assert r.choices[0].text.startswith("20")
    finally:
        server.stop()
    assert on_loop == [False]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_bytes_join_into_the_text(client, stream):
    """OpenAI's chat logprobs ``bytes`` are a token's own UTF-8 bytes, so the tokens of a character split by byte-level
    BPE join into it; they were the bytes of the U+FFFD each such token shows as ([239, 191, 189])."""
    want = "日本語 ∑ café"
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "logprobs": True,
              "top_logprobs": 1, "extra_body": {"guided_choice": [want]}}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        r = client.chat.completions.create(**kw)
        content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert text == want
    assert any(t.token == "\ufffd" for t in content)  # some tokens hold part of a character
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8") == want
    assert all(bytes(t.bytes) == t.token.encode() for t in content if "\ufffd" not in t.token)
