"""Structured outputs: every token is chosen among those the grammar allows, so even a random tiny model's output
parses against its schema; the scheduler (server) and generate agree token for token; bad formats are one line."""
from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest

import trtinfer
from trtinfer.errors import BackendUnavailableError, ConfigError, InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.scheduler import Scheduler
from trtinfer.runtime.structured import normalize_format

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"], "additionalProperties": False},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["color", "count", "ok", "tags", "point", "code"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
PROMPTS = ["The history of the city", "Hello", "A quick brown fox jumps over the lazy dog while the cat"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request, tiny_engine):
    with trtinfer.load(tiny_engine(request.param)) as eng:
        yield eng


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_json_schema_outputs_parse_and_validate(engine, sampled):
    """A random model under the schema's grammar: nested objects, enums, arrays, numbers, patterns, optional and
    bounded strings all come out valid, for a batch, greedy and seeded; the stream is the same text."""
    kw = {"do_sample": sampled, "seed": 4 if sampled else None, "temperature": 1.5}
    results = engine.generate(PROMPTS, max_new_tokens=120, response_format=FORMAT, **kw)
    for r in results:
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        obj = json.loads(r.text)
        jsonschema.validate(obj, SCHEMA)
        assert list(obj) == [k for k in SCHEMA["properties"] if k in obj]  # written in the schema's order
    streamed = "".join(engine.stream(PROMPTS[0], max_new_tokens=120, response_format=FORMAT, **kw))
    assert streamed == results[0].text or sampled  # seeded batches draw per row: the first row alone differs


def test_json_object(engine):
    """Any JSON object: a random model's free strings may not end within the budget, but what it writes is an
    object from its first character, and a finished one parses."""
    for r in engine.generate(PROMPTS, max_new_tokens=60, response_format={"type": "json_object"}, do_sample=True,
                             seed=3):
        assert r.text.startswith("{")
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)


@pytest.mark.parametrize(("fmt", "check"), [
    ({"type": "regex", "regex": r"[0-9]{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"type": "choice", "choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"type": "grammar", "grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
     lambda t: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t)),
    ({"type": "grammar", "grammar": 'root ::= "ab" [0-9] [0-9]'}, lambda t: re.fullmatch(r"ab\d\d", t)),
])
def test_other_formats(engine, fmt, check):
    for r in engine.generate(PROMPTS, max_new_tokens=80, response_format=fmt, do_sample=True, seed=2):
        assert r.finish_reason == "stop" and check(r.text), (fmt, r.text)


def test_scheduler_equals_generate(engine):
    """The server's scheduler applies the same mask: each request = generate of its prompt alone (greedy and
    seeded), with n-gram drafts verified under the grammar too."""
    cfgs = [GenerationConfig(max_new_tokens=100, response_format=FORMAT),
            GenerationConfig(max_new_tokens=100, response_format=FORMAT, do_sample=True, seed=9),
            GenerationConfig(max_new_tokens=100, response_format=FORMAT, prompt_lookup_num_tokens=3)]
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    with Scheduler(engine, max_slots=3) as sched:
        got = [sched.submit(i, c).result(timeout=120) for i, c in zip(ids, cfgs)]
    plain = GenerationConfig(max_new_tokens=100, response_format=FORMAT)
    for r, i, c in zip(got, ids, [cfgs[0], cfgs[1], plain]):
        want = engine.generate(input_ids=[i], config=c)[0]
        assert r.token_ids == want.token_ids and r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), SCHEMA)


@pytest.mark.parametrize("bad", [{"type": "yaml"}, {"type": "json_schema"}, {"type": "choice", "choice": []},
                                 {"type": "choice", "choice": ["a", ""]}, {"type": "regex"}, "not json", 5])
def test_bad_formats_are_one_line(bad):
    with pytest.raises(ConfigError, match="response_format"):
        GenerationConfig(response_format=bad)


def test_malformed_schema_and_unsupported_combinations(engine):
    with pytest.raises(InputError, match="not a usable grammar: Invalid type: nonsense"):
        engine.generate(["x"], max_new_tokens=4,
                        response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}})
    with pytest.raises(InputError, match="drop num_beams"):
        engine.generate(["x"], max_new_tokens=4, num_beams=2, response_format={"type": "json_object"})
    with pytest.raises(InputError, match="not a usable grammar") as e:  # llguidance's excerpt, folded to one line
        engine.generate(["x"], max_new_tokens=4, response_format={"type": "grammar", "grammar": "start: (\n"})
    assert "\n" not in str(e.value)


def test_a_processor_cannot_choose_what_the_grammar_refuses(engine):
    """The grammar's mask applies after the user's logits processor: one that sets a refused token's logit high
    (as force-token processors do) no longer breaks the format (it ran into llguidance's error mid-generation)."""
    forced = engine.tokenizer.encode("x")[-1]

    def force(ids, scores):
        scores[:, forced] = 50.0
        return scores

    for r in engine.generate(PROMPTS, max_new_tokens=8, logits_processor=force,
                             response_format={"type": "regex", "regex": "[0-9]{3}"}):
        assert re.fullmatch(r"[0-9]{3}", r.text) and r.finish_reason == "stop", r.text
    assert normalize_format({"type": "text"}) is None
    assert normalize_format(FORMAT) == normalize_format(json.dumps(FORMAT))


def test_missing_llguidance_is_one_line(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    from trtinfer.runtime.structured import Grammars

    fresh = Grammars(engine.path, int(engine.manifest.geometry["vocab_size"]), (2,))
    with pytest.raises(BackendUnavailableError, match=r"pip install 'trtinfer\[structured\]'"):
        fresh.matcher(normalize_format({"type": "json_object"}))
