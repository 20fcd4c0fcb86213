"""Grammar engines for constrained decoding: llguidance against xgrammar on our own tokenizers.

usage: python -m benchmarks.grammar_engines TOKENIZER_JSON [TOKENIZER_JSON ...] [--libs llguidance xgrammar]
           [--repeats 3] [--batch 8] [--threads N] [--apply-iters 200] [--out NAME]

Runs in a throwaway venv holding both libraries (not the project's: neither is a dependency of trtinfer), e.g.
``python -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install numpy tokenizers llguidance xgrammar``; a library that
does not import is skipped. Each TOKENIZER_JSON is a ``tokenizer.json`` in an engine or stage directory (``LABEL=PATH``
names it; otherwise the label is the directory's ``manifest.json``/``stage.json`` source model, or its name). The
EOS ids come from the sibling ``tokenizer_config.json`` (``eos_token``) and ``generation_config.json``
(``eos_token_id``); the logits width is the geometry's ``vocab_size`` there, or the tokenizer's size. Both
libraries are fed from the raw ``tokenizer.json`` through ``tokenizers`` alone (no ``transformers``):
``llguidance.LLTokenizer(json_text, n_vocab=, eos_token=)`` and ``xgrammar.TokenizerInfo(vocab_by_id,
vocab_type, ...)`` with the vocab type detected from the same JSON.

Per tokenizer and library: the tokenizer-info build time, then its first use (a one-property schema compiled and
walked: lazily built tables, thread pools). Per case (five JSON schemas of increasing complexity, one with two string
``maxLength`` bounds, ``json_object`` (schema ``{"type": "object"}`` in both), ``json_any`` (xgrammar's builtin JSON
grammar, llguidance's schema ``{}``), a regex, a choice list, and a GBNF grammar, the same text for both): the cold
compile time, the per-sequence matcher creation time, then ``--repeats`` walks with a fresh matcher each over a
valid instance, tokenized with the tokenizer and closed with EOS: at every step the allowed-token bitmask is
computed into a numpy int32 array (timed), the next token must be allowed (checked), and it is consumed (timed).
Mean, p50, p99 and max of the mask time in microseconds over all steps of all walks; the first step of the first
walk on its own; a batch of ``--batch`` matchers in lockstep (the library's parallel fill into one (B, ceil(V/32))
array); a rollback of up to 8 tokens, the mask after it against the walk's; how many special tokens (besides EOS)
a mask lets through at most. A case a library cannot compile or walk is recorded with its error. Then the numpy
cost of applying a bitmask to float32 logits of each vocab size (dense and sparse masks, batch 1 and ``--batch``),
and what each library imports and pulls in (the ``importlib.metadata`` closure of its declared dependencies, with
its size on disk). xgrammar imports torch and transformers at import time, so its venv needs them. Prints tables
and writes ``benchmarks/results/grammar_engines_<date>.json`` (``--out NAME``: ``NAME.json``).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from benchmarks.machine import machine_info

RESULTS = Path(__file__).parent / "results"
LIBS = ("llguidance", "xgrammar")
RUNTIME = ("numpy", "tokenizers")  # what the torch-free runtime already carries (with onnxruntime)
HEAVY = ("torch", "transformers", "triton", "pydantic", "tvm_ffi")
ROLLBACK = 8

_OBJ = {"type": "object", "additionalProperties": False}
GBNF = r"""root ::= expr
expr ::= term (ws ("+" | "-") ws term)*
term ::= factor (ws ("*" | "/") ws factor)*
factor ::= number | "(" ws expr ws ")"
number ::= [0-9]+ ("." [0-9]+)?
ws ::= [ ]?
"""
WARMUP = {"name": "warmup", "kind": "json_schema", "instance": {"a": 1},
          "schema": {**_OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
CASES_JSON_INSTANCE = {"id": "evt_19", "ok": True, "score": -0.125, "missing": None, "tags": ["a", "b c", "café"],
                       "nested": {"list": [1, 2.5, [3, {"deep": "quote \" and \\n"}]], "empty": {}}, "count": 3}
CHOICES = ["positive", "negative", "neutral", "mixed"]
CASES: list[dict[str, Any]] = [
    {"name": "flat", "kind": "json_schema",
     "schema": {**_OBJ, "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "active": {"type": "boolean"}},
                "required": ["name", "age", "active"]},
     "instance": {"name": "Ada Lovelace", "age": 36, "active": True}},
    {"name": "nested", "kind": "json_schema",
     "schema": {**_OBJ, "properties": {
         "user": {**_OBJ, "properties": {
             "id": {"type": "integer"}, "name": {"type": "string"},
             "address": {**_OBJ, "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                "country": {"type": "string"}},
                         "required": ["street", "city", "country"]}},
             "required": ["id", "name", "address"]},
         "created": {"type": "string"}}, "required": ["user", "created"]},
     "instance": {"user": {"id": 1042, "name": "Grace Hopper",
                           "address": {"street": "12 Navy Yard Road", "city": "Arlington", "country": "USA"}},
                  "created": "1952-05-01 09:30"}},
    {"name": "array_of_objects", "kind": "json_schema",
     "schema": {**_OBJ, "properties": {
         "order_id": {"type": "string"},
         "items": {"type": "array", "minItems": 1, "items": {**_OBJ, "properties": {
             "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
             "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
         "paid": {"type": "boolean"}}, "required": ["order_id", "items", "paid"]},
     "instance": {"order_id": "A-77812", "items": [{"sku": "KB-101", "qty": 2, "price": 49.5},
                                                   {"sku": "MS-7", "qty": 1, "price": 19.99},
                                                   {"sku": "USB-C-2M", "qty": 3, "price": 7.25}], "paid": False}},
    {"name": "enums_optional", "kind": "json_schema",
     "schema": {**_OBJ, "properties": {
         "status": {"enum": ["open", "in_progress", "blocked", "done"]},
         "priority": {"type": "integer", "enum": [1, 2, 3]},
         "tags": {"type": "array", "items": {"type": "string"}},
         "note": {"type": "string"},
         "assignee": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
         "required": ["status", "priority"]},
     "instance": {"status": "in_progress", "priority": 2, "tags": ["backend", "urgent"], "assignee": None}},
    {"name": "patterns_ranges", "kind": "json_schema",
     "schema": {**_OBJ, "properties": {
         "email": {"type": "string", "pattern": r"^[a-z0-9._+-]+@[a-z0-9-]+(\.[a-z0-9-]+)+$"},
         "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
         "zip": {"type": "string", "pattern": r"^\d{5}$"},
         "score": {"type": "number", "minimum": 0, "maximum": 100},
         "count": {"type": "integer", "minimum": 0, "maximum": 1000},
         "level": {"type": "integer", "minimum": -5, "maximum": 5}},
         "required": ["email", "date", "zip", "score", "count", "level"]},
     "instance": {"email": "jane.doe+news@example.co.uk", "date": "2026-11-26", "zip": "94107", "score": 87.5,
                  "count": 412, "level": -3}},
    {"name": "string_maxlength", "kind": "json_schema",
     "schema": {**_OBJ, "properties": {"title": {"type": "string", "maxLength": 64},
                                       "body": {"type": "string", "maxLength": 256}}, "required": ["title", "body"]},
     "instance": {"title": "Quarterly report", "body": "Revenue grew 12% on the quarter. Costs were flat, and the "
                                                       "new plant opens in May."}},
    {"name": "json_object", "kind": "json_object", "instance": CASES_JSON_INSTANCE},
    {"name": "json_any", "kind": "json_any", "instance": CASES_JSON_INSTANCE},
    {"name": "regex_email", "kind": "regex", "regex": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}",
     "text": "jane.doe+news@example.co.uk"},
    {"name": "choice", "kind": "choice", "choices": CHOICES, "text": "neutral"},
    {"name": "gbnf_arith", "kind": "grammar", "gbnf": GBNF, "text": "(12.5 + 3) * 4 - 7 / (2 + 1)"},
]


def us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def stats_us(values: list[float]) -> dict[str, float]:
    return {"mean_us": us(statistics.fmean(values)), "p50_us": us(pct(values, 50)), "p99_us": us(pct(values, 99)),
            "max_us": us(max(values)), "n": len(values)}


def bit(bitmask_row: np.ndarray, token: int) -> bool:
    return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)


def unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """(..., ceil(V/32)) int32 bitmask -> (..., V) bool: bit j of word w is token 32*w + j (little-endian words)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, count=vocab, bitorder="little").view(bool)


# --- tokenizers ----------------------------------------------------------------------------------------------------
def load_tokenizer(arg: str) -> dict[str, Any]:
    label, _, path_s = arg.rpartition("=") if "=" in arg else ("", "", arg)
    path = Path(path_s).expanduser().resolve()
    text = path.read_text()
    tok = Tokenizer.from_str(text)
    folder = path.parent

    def sibling(name: str) -> dict[str, Any]:
        f = folder / name
        return json.loads(f.read_text()) if f.is_file() else {}

    geometry = {}
    for name in ("manifest.json", "stage.json"):
        meta = sibling(name)
        geometry = geometry or meta.get("geometry", {})
        label = label or meta.get("source", {}).get("model", "")
    label = label or folder.name
    eos: list[int] = []
    tc_eos = sibling("tokenizer_config.json").get("eos_token")
    tc_eos = tc_eos.get("content") if isinstance(tc_eos, dict) else tc_eos
    if tc_eos and tok.token_to_id(tc_eos) is not None:
        eos.append(tok.token_to_id(tc_eos))
    gc_eos = sibling("generation_config.json").get("eos_token_id")
    for e in gc_eos if isinstance(gc_eos, list) else [gc_eos] if gc_eos is not None else []:
        if e not in eos:
            eos.append(int(e))
    if not eos:
        raise SystemExit(f"{path}: no EOS in tokenizer_config.json or generation_config.json beside it")
    size = tok.get_vocab_size(with_added_tokens=True)
    vocab = max(size, int(geometry.get("vocab_size", 0)))
    special = sorted({t["id"] for t in json.loads(text).get("added_tokens", []) if t.get("special")} - set(eos))
    return {"label": label, "path": str(path), "json": text, "tok": tok, "vocab": vocab, "tokenizer_size": size,
            "eos": eos, "special": special}


# --- the two libraries behind one interface ------------------------------------------------------------------------
class LLGuidance:
    name = "llguidance"

    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.numpy as lln
        self.llg, self.lln, self.threads = llguidance, lln, threads
        self.version = llguidance.__version__
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def build(self, t: dict[str, Any]) -> None:
        self.tok = self.llg.LLTokenizer(t["json"], n_vocab=t["vocab"], eos_token=t["eos"])

    def grammar(self, case: dict[str, Any]) -> str:
        m = self.llg.LLMatcher
        if case["kind"] == "json_schema":
            return m.grammar_from_json_schema(case["schema"])
        if case["kind"] == "json_object":
            return m.grammar_from_json_schema({"type": "object"})
        if case["kind"] == "json_any":
            return m.grammar_from_json_schema({})
        if case["kind"] == "regex":
            return m.grammar_from_regex(case["regex"])
        if case["kind"] == "choice":
            return self.llg.grammar_from("choice", json.dumps(case["choices"]))
        return self.llg.grammar_from("gbnf", case["gbnf"])

    def compile(self, case: dict[str, Any]) -> str:
        """llguidance has no separate compiled object: the matcher builds its parser from the grammar (lazily)."""
        g = self.grammar(case)
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return g

    def matcher(self, compiled: str) -> Any:
        return self.llg.LLMatcher(self.tok, compiled, log_level=0)

    def fill(self, m: Any, bitmask: np.ndarray, index: int = 0) -> None:
        self.lln.fill_next_token_bitmask(m, bitmask, index)

    def consume(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m: Any, n: int) -> None:
        assert m.rollback(n), m.get_error()

    def accepting(self, m: Any) -> bool:
        return m.is_accepting()

    def terminated(self, m: Any) -> bool:
        return m.is_stopped() and not m.is_error()

    def error(self, m: Any) -> str:
        return m.get_error()

    def batch_fill(self, ms: list[Any], bitmask: np.ndarray) -> None:
        self.lln.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def batch_consume(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return self.lln.consume_token_par(self.executor, list(zip(ms, tokens)))


class XGrammar:
    name = "xgrammar"

    def __init__(self, threads: int) -> None:
        import xgrammar
        self.xgr, self.threads = xgrammar, threads
        self.version = md.version("xgrammar")
        self.batcher = xgrammar.BatchGrammarMatcher(max_threads=threads)

    def build(self, t: dict[str, Any]) -> None:
        vocab = [""] * t["tokenizer_size"]
        for token, i in t["tok"].get_vocab(with_added_tokens=True).items():
            vocab[i] = token
        meta = self.xgr.TokenizerInfo._detect_metadata_from_hf(t["json"])
        self.info = self.xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=t["vocab"], stop_token_ids=t["eos"],
                                           add_prefix_space=meta["add_prefix_space"])
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)

    def compile(self, case: dict[str, Any]) -> Any:
        c = self.compiler
        if case["kind"] == "json_schema":
            return c.compile_json_schema(json.dumps(case["schema"]))
        if case["kind"] == "json_object":
            return c.compile_json_schema(json.dumps({"type": "object"}))
        if case["kind"] == "json_any":
            return c.compile_builtin_json_grammar()
        if case["kind"] == "regex":
            return c.compile_regex(case["regex"])
        if case["kind"] == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in case["choices"]))
        return c.compile_grammar(case["gbnf"])

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: np.ndarray, index: int = 0) -> None:
        m.fill_next_token_bitmask(bitmask, index)  # numpy through DLPack: no torch tensor needed

    def consume(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)

    def accepting(self, m: Any) -> bool:
        return m.is_completed()

    def terminated(self, m: Any) -> bool:
        return m.is_terminated()

    def error(self, m: Any) -> str:
        return ""

    def batch_fill(self, ms: list[Any], bitmask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def batch_consume(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)


ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar}


# --- one case ------------------------------------------------------------------------------------------------------
def case_text(case: dict[str, Any]) -> str:
    return json.dumps(case["instance"], ensure_ascii=False) if "instance" in case else case["text"]


def run_case(eng: Any, t: dict[str, Any], case: dict[str, Any], repeats: int, batch: int) -> dict[str, Any]:
    vocab, eos = t["vocab"], t["eos"][0]
    ids = t["tok"].encode(case_text(case), add_special_tokens=False).ids + [eos]
    words = (vocab + 31) // 32
    special = np.array(t["special"], dtype=np.int64)
    row: dict[str, Any] = {"tokens": len(ids)}
    t0 = time.perf_counter()
    compiled = eng.compile(case)
    row["compile_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    created, masks, consumes, allowed, leak, first = [], [], [], [], 0, 0.0
    walk_means = []
    walk_masks: list[np.ndarray] = []
    bm = np.full((1, words), -1, dtype=np.int32)
    for r in range(repeats):
        t0 = time.perf_counter()
        m = eng.matcher(compiled)
        created.append(time.perf_counter() - t0)
        this = []
        for step, token in enumerate(ids):
            t0 = time.perf_counter()
            eng.fill(m, bm)
            t1 = time.perf_counter()
            if not bit(bm[0], token):
                raise RuntimeError(f"step {step}: token {token} {t['tok'].id_to_token(token)!r} not allowed "
                                   f"after {t['tok'].decode(ids[:step])!r} {eng.error(m)}")
            t2 = time.perf_counter()
            if not eng.consume(m, token):
                raise RuntimeError(f"step {step}: consume {token} failed {eng.error(m)}")
            t3 = time.perf_counter()
            this.append(t1 - t0)
            consumes.append(t3 - t2)
            if r == 0:
                walk_masks.append(bm[0].copy())
                flags = unpack(bm[0], vocab)
                allowed.append(int(flags.sum()))
                leak = max(leak, int(flags[special].sum()) if special.size else 0)
                if step == 0:
                    first = t1 - t0
            if step == len(ids) - 2 and not eng.accepting(m):
                raise RuntimeError("not accepting before EOS")
        if not eng.terminated(m):
            raise RuntimeError("not terminated after EOS")
        masks += this
        walk_means.append(us(statistics.fmean(this)))
    row.update({"matcher_create_us": us(statistics.fmean(created)), "mask": stats_us(masks),
                "mask_walk_means_us": walk_means, "first_mask_us": us(first),
                "consume_mean_us": us(statistics.fmean(consumes)), "allowed_mean": round(statistics.fmean(allowed)),
                "allowed_min": min(allowed), "special_tokens_allowed_max": leak})
    # rollback: consume all but EOS, roll back up to ROLLBACK tokens, the mask there must equal the walk's
    m = eng.matcher(compiled)
    body = ids[:-1]
    for token in body:
        eng.consume(m, token)
    k = min(ROLLBACK, len(body))
    t0 = time.perf_counter()
    eng.rollback(m, k)
    rb = time.perf_counter() - t0
    eng.fill(m, bm)
    same = bool(np.array_equal(bm[0], walk_masks[len(body) - k]))
    ok = all(eng.consume(m, token) for token in body[len(body) - k:]) and eng.accepting(m)
    row.update({"rollback_tokens": k, "rollback_us": us(rb), "rollback_ok": same and ok})
    # a batch in lockstep, one parallel fill into one (B, words) array per step
    if batch > 1:
        ms = [eng.matcher(compiled) for _ in range(batch)]
        bb = np.full((batch, words), -1, dtype=np.int32)
        fills, cons = [], []
        for token in ids:
            t0 = time.perf_counter()
            eng.batch_fill(ms, bb)
            t1 = time.perf_counter()
            assert all(bit(bb[i], token) for i in range(batch)), "batch mask forbids the next token"
            assert all(eng.batch_consume(ms, [token] * batch))
            cons.append(time.perf_counter() - t1)
            fills.append(t1 - t0)
        row.update({f"batch{batch}_mask": stats_us(fills), f"batch{batch}_consume_mean_us": us(statistics.fmean(cons))})
    return row


# --- applying a bitmask to logits in numpy -------------------------------------------------------------------------
# LUT8[byte] is the float32 bias (0 allowed, -inf not) of the 8 tokens one bitmask byte covers (little-endian bits)
LUT8 = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
                np.float32(0), np.float32(-np.inf)).astype(np.float32)


def apply_methods(bitmask: np.ndarray, vocab: int, expect: np.ndarray, lln: Any) -> dict[str, Any]:
    """Ways to set the disallowed logits of a (B, V) float32 array to -inf in place, from a (B, words) int32 bitmask."""
    neg = np.empty(expect.shape, dtype=bool)

    def unpack_only(x: np.ndarray) -> np.ndarray:
        unpack(bitmask, vocab)
        return expect

    def copyto(x: np.ndarray) -> np.ndarray:
        np.logical_not(unpack(bitmask, vocab), out=neg)
        np.copyto(x, np.float32(-np.inf), where=neg)
        return x

    def where(x: np.ndarray) -> np.ndarray:
        return np.where(unpack(bitmask, vocab), x, np.float32(-np.inf))

    def lut8(x: np.ndarray) -> np.ndarray:
        x += np.take(LUT8, bitmask.view(np.uint8), axis=0).reshape(x.shape[0], -1)[:, :vocab]
        return x

    def gather(x: np.ndarray) -> np.ndarray:
        rows, cols = np.nonzero(unpack(bitmask, vocab))
        y = np.full_like(x, -np.inf)
        y[rows, cols] = x[rows, cols]
        return y

    def argmax_reference(x: np.ndarray) -> np.ndarray:
        np.argmax(x, axis=-1)  # greedy's own cost: test the winner's bit, mask only when it is not allowed
        return expect

    methods = {"argmax_reference": argmax_reference, "unpack_only": unpack_only, "unpackbits+copyto": copyto, "unpackbits+where": where,
               "lut8_take+add": lut8, "unpackbits+nonzero_gather": gather}
    if lln is not None:
        def llg_apply(x: np.ndarray) -> np.ndarray:
            lln.apply_token_bitmask_inplace(x, bitmask)
            return x
        methods["llguidance.numpy.apply_token_bitmask_inplace"] = llg_apply
    return methods


def apply_costs(vocab: int, batch: int, iters: int, lln: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    words = (vocab + 31) // 32
    out: dict[str, Any] = {}
    for density, n_allowed in (("dense", vocab - 2000), ("sparse", 100)):
        for b in (1, batch):
            allowed = np.zeros((b, vocab), dtype=bool)
            for i in range(b):
                allowed[i, rng.choice(vocab, n_allowed, replace=False)] = True
            packed = np.packbits(allowed, axis=-1, bitorder="little")
            bitmask = np.zeros((b, words * 4), dtype=np.uint8)
            bitmask[:, :packed.shape[1]] = packed
            bitmask = bitmask.view(np.int32)
            assert np.array_equal(unpack(bitmask, vocab), allowed)
            assert all(bit(bitmask[0], int(j)) for j in np.flatnonzero(allowed[0])[:50])
            logits = rng.standard_normal((b, vocab)).astype(np.float32)
            expect = np.where(allowed, logits, -np.inf).astype(np.float32)
            methods = apply_methods(bitmask, vocab, expect, lln)
            res = {}
            for name, fn in methods.items():
                t0 = time.perf_counter()
                assert np.array_equal(fn(logits.copy()), expect), name
                n = min(iters, max(5, int(0.5 / (time.perf_counter() - t0))))  # about half a second a method
                times = []
                for _ in range(n):
                    x = logits.copy()
                    t0 = time.perf_counter()
                    fn(x)
                    times.append(time.perf_counter() - t0)
                res[name] = {"median_us": us(statistics.median(times)), "min_us": us(min(times))}
            out[f"{density} b{b}"] = res
    return out


# --- footprint ------------------------------------------------------------------------------------------------------
def _req_name(req: str) -> str | None:
    if "extra ==" in req:
        return None
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
    return m.group(0).lower().replace("_", "-") if m else None


def closure(names: tuple[str, ...]) -> dict[str, Any]:
    """The installed distributions ``names`` declare, transitively (extras left out), with their size on disk."""
    seen: dict[str, int] = {}
    missing: list[str] = []
    todo = [n.lower() for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name in missing:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        size = 0
        for f in dist.files or []:
            p = Path(str(f.locate()))
            size += p.stat().st_size if p.is_file() else 0
        seen[name] = size
        todo += [r for r in map(_req_name, dist.requires or []) if r]
    return {"dists": {k: round(v / 2**20, 1) for k, v in sorted(seen.items())},
            "total_mib": round(sum(seen.values()) / 2**20, 1), "not_installed": sorted(missing)}


def footprint(lib: str) -> dict[str, Any]:
    dist = md.distribution(lib)
    runtime = closure(RUNTIME)["dists"]
    own = closure((lib,))
    extra = {k: v for k, v in own["dists"].items() if k not in runtime}
    probe = (f"import json, sys, time; t = time.perf_counter(); import {lib}; "
             + ("import llguidance.numpy; " if lib == "llguidance" else "")
             + "print(json.dumps({'import_s': round(time.perf_counter() - t, 3), "
             + f"'imports': sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})}}))")
    proc = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True)
    imp = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr.strip().splitlines()[-1:]}
    return {"version": dist.version, "requires_dist": dist.requires or [], "closure": own,
            "beyond_runtime": {"dists": extra, "total_mib": round(sum(extra.values()), 1)}, "import": imp}


# --- main -----------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tokenizers", nargs="+", help="tokenizer.json paths (LABEL=PATH to name one)")
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=LIBS)
    ap.add_argument("--cases", nargs="+", default=[c["name"] for c in CASES], choices=[c["name"] for c in CASES])
    ap.add_argument("--repeats", type=int, default=3, help="walks per case, a fresh matcher each")
    ap.add_argument("--batch", type=int, default=8, help="matchers stepped in lockstep (1: skip)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for xgrammar's compiler and both libraries' batch fill")
    ap.add_argument("--apply-iters", type=int, default=200)
    ap.add_argument("--out", help="results file name without .json (default grammar_engines_<date>)")
    args = ap.parse_args()

    engines = {}
    for lib in args.libs:
        try:
            engines[lib] = ENGINES[lib](args.threads)
        except ImportError as e:
            print(f"skipping {lib}: {e}")
    cases = [c for c in CASES if c["name"] in args.cases]
    toks = [load_tokenizer(a) for a in args.tokenizers]
    results: dict[str, Any] = {}
    for t in toks:
        print(f"\n{t['label']}: {t['path']}\n  vocab {t['vocab']} (tokenizer {t['tokenizer_size']}), eos {t['eos']}, "
              f"{len(t['special'])} other special tokens")
        per: dict[str, Any] = {}
        for lib, eng in engines.items():
            t0 = time.perf_counter()
            eng.build(t)
            entry: dict[str, Any] = {"tokenizer_build_ms": round((time.perf_counter() - t0) * 1e3, 1), "cases": {}}
            t0 = time.perf_counter()
            warm = run_case(eng, t, WARMUP, 1, 1)  # first use of the tokenizer info: lazily built tables, pools
            entry["first_use_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            entry["first_use_compile_ms"] = warm["compile_ms"]
            for case in cases:
                try:
                    entry["cases"][case["name"]] = run_case(eng, t, case, args.repeats, args.batch)
                except Exception as e:  # noqa: BLE001 - a case one library cannot do is a result, not a crash
                    entry["cases"][case["name"]] = {"error": f"{type(e).__name__}: {e}"[:400]}
            pooled = [c for n, c in entry["cases"].items() if "error" not in c and n in
                      {k["name"] for k in cases if k["kind"] == "json_schema"}]
            if pooled:
                entry["json_schema_cases"] = {
                    "compile_ms_mean": round(statistics.fmean(c["compile_ms"] for c in pooled), 3),
                    "mask_mean_us": us(statistics.fmean(c["mask"]["mean_us"] / 1e6 for c in pooled)),
                    "mask_p99_us_max": max(c["mask"]["p99_us"] for c in pooled)}
            per[lib] = entry
        results[t["label"]] = {"path": t["path"], "vocab": t["vocab"], "tokenizer_size": t["tokenizer_size"],
                               "eos": t["eos"], "special_tokens": len(t["special"]), "libs": per}
        b = args.batch
        head = (f"  {'lib':<11}{'case':<18}{'compile ms':>11}{'matcher us':>11}{'steps':>6}{'mask mean':>10}"
                f"{'p50':>8}{'p99':>8}{'max':>8}{'first':>8}{'consume':>8}" + (f"{f'b{b} mean':>9}{'p99':>8}" if b > 1
                                                                          else "") + f"{'leak':>6}  rollback")
        print("  tokenizer info build, then first use (a one-property schema compiled and walked): " + ", ".join(
            f"{lib} {e['tokenizer_build_ms']:.0f} + {e['first_use_ms']:.0f} ms" for lib, e in per.items()))
        print(head)
        for lib, entry in per.items():
            for name, c in entry["cases"].items():
                if "error" in c:
                    print(f"  {lib:<11}{name:<18}ERROR {c['error'][:90]}")
                    continue
                mk = c["mask"]
                line = (f"  {lib:<11}{name:<18}{c['compile_ms']:>11.1f}{c['matcher_create_us']:>11.0f}{c['tokens']:>6}"
                        f"{mk['mean_us']:>10.1f}{mk['p50_us']:>8.1f}{mk['p99_us']:>8.0f}{mk['max_us']:>8.0f}"
                        f"{c['first_mask_us']:>8.0f}{c['consume_mean_us']:>8.1f}")
                if b > 1:
                    line += f"{c[f'batch{b}_mask']['mean_us']:>9.0f}{c[f'batch{b}_mask']['p99_us']:>8.0f}"
                print(line + f"{c['special_tokens_allowed_max']:>6}  {'ok' if c['rollback_ok'] else 'FAIL'} "
                             f"{c['rollback_us']:.0f}us")

    lln = engines["llguidance"].lln if "llguidance" in engines else None
    apply = {}
    for vocab in sorted({t["vocab"] for t in toks}):
        apply[str(vocab)] = apply_costs(vocab, args.batch, args.apply_iters, lln)
        print(f"\napplying a bitmask to float32 logits, V={vocab} (median us):")
        for shape, res in apply[str(vocab)].items():
            print(f"  {shape:<11}" + "  ".join(f"{k} {v['median_us']:.0f}" for k, v in res.items()))
    foot = {lib: footprint(lib) for lib in engines}
    print("\nfootprint beyond numpy + tokenizers:")
    for lib, f in foot.items():
        print(f"  {lib} {f['version']}: {f['beyond_runtime']['total_mib']} MiB {list(f['beyond_runtime']['dists'])}; "
              f"import {f['import']}")

    date = datetime.date.today().isoformat()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{args.out or f'grammar_engines_{date}'}.json"
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    record = {"machine": machine_info(), "load_average_1_5_15_min": load, "date": date, "args": vars(args),
              "versions": {lib: e.version for lib, e in engines.items()} | {
                  "numpy": np.__version__, "tokenizers": md.version("tokenizers")},
              "cases": [dict(c) | {"text": case_text(c)} for c in cases],
              "tokenizers": results, "apply_bitmask": apply, "footprint": foot}
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
