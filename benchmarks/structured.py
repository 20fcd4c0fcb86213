"""Structured outputs on a real chat model: validity over many schemas, and what the grammar mask costs per step.

usage: python -m benchmarks.structured [--engine DIR] [--per-schema 20] [--bs 1 8] [--steps 48]

1. Validity: 10 JSON schemas (flat, nested, arrays, enums, bounded numbers, patterns, optional fields, ...), each
   asked ``--per-schema`` times through the chat template with sampling (temperature 0.7, a seed per request):
   the share of outputs that parse and validate against their schema (``jsonschema``), and why the others failed.
2. Mask cost: the same prompts decoded with and without a schema, in the same run, interleaved, at each batch size:
   decode ms per step (``Timings.decode_ms``; whole steps on 2 shared cores are noisy at batch 1), and the time
   spent in the grammar's own calls (mask + consume, timed around the real calls) per step, as a share of the
   unconstrained step; the schema's compile time (first matcher) and the tokenizer's build time (once per engine).

Default engine: SmolLM2-135M-Instruct int4 (``benchmarks/.engines/smollm2-135m-int4-cpu``, built if missing).
Prints tables, writes benchmarks/results/structured_<cpu>_<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema

from benchmarks.machine import cpu_kind, machine_info

RESULTS = Path(__file__).parent / "results"

S = {"type": "string", "maxLength": 24}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"city": S, "location": {
        "type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                         "lon": {"type": "integer", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}}, "required": ["city", "location"],
        "additionalProperties": False},
    "list": {"type": "object", "properties": {"fruits": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}},
             "required": ["fruits"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                              "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
             "required": ["sentiment", "confidence"], "additionalProperties": False},
    "bool": {"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": S},
             "required": ["answer", "reason"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                                                 "event": S}, "required": ["date", "event"],
                "additionalProperties": False},
    "optional": {"type": "object", "properties": {"title": S, "subtitle": S, "pages": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 2000}},
                 "required": ["title"], "additionalProperties": False},
    "objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": S, "qty": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {"name": {"enum": ["get_weather", "get_time"]}, "arguments": {
        "type": "object", "properties": {"city": S}, "required": ["city"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                 "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                 "op": {"enum": ["+", "-", "*"]}}, "required": ["a", "b", "op"],
                "additionalProperties": False},
}
QUESTIONS = {
    "person": "Invent a person.", "nested": "Name a city and where it is.", "list": "List some fruits.",
    "enum": "How does 'I love this phone' feel?", "bool": "Is water wet?", "pattern": "When did something happen?",
    "optional": "Describe a book.", "objects": "What is in a shopping cart?", "tool_call": "What's the weather in Oslo?",
    "numbers": "Give me an arithmetic exercise.",
}


def fmt(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


def validity(engine: Any, per_schema: int) -> dict[str, Any]:
    rows, failures = {}, []
    for name, schema in SCHEMAS.items():
        ok = 0
        prompts = [[{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": QUESTIONS[name]}]
                   for _ in range(per_schema)]
        results = []
        for seed in range(per_schema):  # one request per seed (as a server would see them)
            results += engine.generate([prompts[seed]], chat=True, max_new_tokens=96, do_sample=True,
                                       temperature=0.7, seed=seed, response_format=fmt(name))
        for r in results:
            try:
                jsonschema.validate(json.loads(r.text), schema)
                ok += 1
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append({"schema": name, "finish_reason": r.finish_reason, "text": r.text[:200],
                                 "error": str(e)[:200]})
        rows[name] = {"valid": ok, "of": per_schema, "example": results[0].text}
    return {"per_schema": rows, "valid": sum(r["valid"] for r in rows.values()),
            "total": sum(r["of"] for r in rows.values()), "failures": failures}


def mask_cost(engine: Any, batch_sizes: list[int], steps: int, rounds: int = 3) -> list[dict[str, Any]]:
    """Per batch size: the plain decode step (ms), the constrained one, and the time spent in the grammar's calls
    per step (mask + consume for every row, timed around the real calls) as a share of the plain step."""
    from trtinfer.runtime import structured

    spent = [0.0, 0]  # seconds inside Matcher.mask/consume, rows masked

    def timed(fn: Any) -> Any:
        def call(self: Any, *a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(self, *a)
            finally:
                spent[0] += time.perf_counter() - t0
                spent[1] += fn.__name__ == "mask"
        return call

    out = []
    for bs in batch_sizes:
        prompts = [[{"role": "user", "content": QUESTIONS[n]}] for n in list(SCHEMAS)] * (bs // len(SCHEMAS) + 1)
        prompts = prompts[:bs]
        plain, constrained, per_row = [], [], []
        for _ in range(rounds):  # interleaved: the same machine state for both
            rs = engine.generate(prompts, chat=True, max_new_tokens=steps, ignore_eos=True)
            plain.append(statistics.median(ms for r in rs for ms in r.timings.decode_ms))
            spent[:] = [0.0, 0]
            mask, consume = structured.Matcher.mask, structured.Matcher.consume
            structured.Matcher.mask, structured.Matcher.consume = timed(mask), timed(consume)  # type: ignore
            try:
                rs = engine.generate(prompts, chat=True, max_new_tokens=steps, response_format=fmt("objects"))
            finally:
                structured.Matcher.mask, structured.Matcher.consume = mask, consume  # type: ignore
            constrained.append(statistics.median(ms for r in rs for ms in r.timings.decode_ms))
            per_row.append(spent[0] * 1000 / max(1, spent[1]))
        p, c, row_ms = statistics.median(plain), statistics.median(constrained), statistics.median(per_row)
        out.append({"batch_size": bs, "plain_step_ms": round(p, 3), "schema_step_ms": round(c, 3),
                    "grammar_ms_per_row": round(row_ms, 4), "grammar_share": round(row_ms * bs / p, 4)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path(__file__).parent / ".engines" / "smollm2-135m-int4-cpu")
    ap.add_argument("--per-schema", type=int, default=20)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    import trtinfer
    from trtinfer.runtime.structured import normalize_format

    if not (args.engine / "manifest.json").is_file():
        from trtinfer.builder import BuildConfig, build

        build("smollm2-135m", args.engine, BuildConfig(precision="int4"), progress=False, overwrite=True)
    engine = trtinfer.load(args.engine)
    vocab = int(engine.manifest.geometry["vocab_size"])
    grammars = engine.tokenizer.grammars(vocab)
    t0 = time.perf_counter()
    grammars.tokenizer()
    tokenizer_s = time.perf_counter() - t0
    compile_ms = {}
    for name in SCHEMAS:
        t0 = time.perf_counter()
        grammars.matcher(normalize_format(fmt(name)))
        compile_ms[name] = round((time.perf_counter() - t0) * 1000, 2)
    valid = validity(engine, args.per_schema)
    cost = mask_cost(engine, args.bs, args.steps)
    print(f"validity: {valid['valid']}/{valid['total']} outputs parse and validate ({len(SCHEMAS)} schemas x "
          f"{args.per_schema}, sampled)")
    for name, r in valid["per_schema"].items():
        print(f"  {name:<10} {r['valid']:>3}/{r['of']:<3} compile {compile_ms[name]:>7.2f} ms  e.g. {r['example'][:70]}")
    print(f"tokenizer for the grammar engine: {tokenizer_s:.2f} s (once per engine)")
    print(f"{'batch':>5} {'plain ms/step':>14} {'schema ms/step':>15} {'grammar ms/row':>15} {'share of step':>14}")
    for c in cost:
        print(f"{c['batch_size']:>5} {c['plain_step_ms']:>14.2f} {c['schema_step_ms']:>15.2f} "
              f"{c['grammar_ms_per_row']:>15.3f} {c['grammar_share']:>13.1%}")
    info = machine_info()
    date = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"structured_{cpu_kind(info)}_{date}.json"
    out.write_text(json.dumps({"machine": info, "date": date, "engine": str(args.engine), "args": {
        k: str(v) for k, v in vars(args).items()}, "tokenizer_build_s": round(tokenizer_s, 3), "compile_ms": compile_ms,
        "validity": valid, "mask_cost": cost}, indent=1))
    print(f"wrote {out}")
    return 0 if valid["valid"] == valid["total"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
