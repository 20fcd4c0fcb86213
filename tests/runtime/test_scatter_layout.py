"""The ``tensorrt`` target's graph (scatter_buffer KV layout) driven by the runtime's own feeds, on ONNX Runtime CPU.

TensorRT cannot run here, but the graph it would compile and the feeds its session would send can: the session for
``scatter_buffer`` graphs on ONNX Runtime uses the same :mod:`trtinfer.runtime.kv_feeds` planning as the TensorRT
session, binds ``present.*`` to the ``past_key_values.*`` buffer (in place, as TensorRT's KV-cache update layer
requires) and must give the CPU engine's greedy tokens and scores.
"""
from __future__ import annotations

import numpy as np
import pytest
from tiny_models import stage_engine, whole_stage

import trtinfer
from tests.runtime.test_scheduler import check_refill
from trtinfer.export import ExportConfig
from trtinfer.export.onnx_export import export_cached
from trtinfer.passes import PassConfig
from trtinfer.passes.optimizer import optimize_cached
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.offline import Generation
from trtinfer.runtime.scoring import open_stage_session, score_ids
from trtinfer.runtime.slots import SlotCache
from trtinfer.runtime.tokenizer import EngineTokenizer

MAX_SEQ = 48
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11, 60], [8, 9, 10], [200, 201]]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def pair(request, tiny_model_dir, tiny_engine):
    arch = request.param
    stage = optimize_cached(export_cached(tiny_model_dir(arch), ExportConfig()),
                            PassConfig(target="tensorrt", max_seq_len=MAX_SEQ))
    assert stage.kv_layout == "scatter_buffer"
    return whole_stage(stage), tiny_engine(arch)  # a whole copy: the stage's weights stay in the checkpoint


def test_generation_matches_the_cpu_engine(pair):
    stage, engine = pair
    cfg = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    with open_stage_session(stage) as session, trtinfer.load(engine) as ref:
        tok = EngineTokenizer(stage.path, stage.info.get("tokenizer", {}))
        gen = Generation(stage_engine(session, tok, len(PROMPTS), MAX_SEQ), PROMPTS, cfg)
        list(gen.events())
        want = ref.generate(input_ids=PROMPTS, max_new_tokens=8, ignore_eos=True)
        assert [r.token_ids for r in gen.results] == [r.token_ids for r in want]
        # the graph writes the KV buffers it is given, in place: a prefill fills each row's first positions (a short
        # row's padding too, overwritten later) and a decode step the next one, nothing after them
        cache = SlotCache(session, len(PROMPTS), MAX_SEQ)
        assert cache.values[0].shape()[2] == MAX_SEQ  # static slot count, as TensorRT needs
        logits = cache.prefill_rows(0, PROMPTS)
        cache.decode({r: int(lg.argmax()) for r, lg in enumerate(logits)})
        kv = cache.values[0].numpy()
        width = max(len(p) for p in PROMPTS)
        for r, p in enumerate(PROMPTS):
            assert kv[r, :, :len(p) + 1].any(axis=-1).all() and not kv[r, :, width + 1:].any()


def test_scores_match_the_cpu_engine(pair):
    stage, engine = pair
    ids = list(range(3, 40))
    with open_stage_session(stage) as session, trtinfer.load(engine) as ref:
        got = score_ids(session, ids, chunk=16).logprobs
        want = ref.score(input_ids=[ids])[0].logprobs
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_sequence_longer_than_the_buffers_is_an_input_error(pair):
    stage, _ = pair
    from trtinfer.errors import InputError

    with open_stage_session(stage) as session, pytest.raises(InputError, match="do not fit"):
        SlotCache(session, 1, MAX_SEQ).prefill(0, list(range(3, 3 + MAX_SEQ + 1)))


def test_served_by_the_scheduler_with_prefix_caching(pair):
    """The same runner code serves the scatter graph: continuous batching (batched fresh prefill, chunks after a
    reused prefix, batched decode) gives the CPU engine's greedy tokens."""
    from types import SimpleNamespace

    from trtinfer.runtime.scheduler import Scheduler

    stage, engine = pair
    cfg = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    shared = [5, 17, 42, 99, 7, 3, 250, 11, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
    prompts = [*PROMPTS, shared + [1, 2], shared + [3]]
    with open_stage_session(stage) as session, trtinfer.load(engine) as ref:
        served = SimpleNamespace(session=session, manifest=ref.manifest, generation_defaults=cfg,
                                 tokenizer=EngineTokenizer(stage.path, stage.info.get("tokenizer", {})))
        with Scheduler(served, max_slots=3, max_model_len=MAX_SEQ, prefill_chunk=64) as sched:
            assert sched.cache.capacity == MAX_SEQ and sched.cache.layout.name == "scatter_buffer"
            check_refill(session, MAX_SEQ)
            got = [r.result(timeout=60) for r in [sched.submit(p, cfg) for p in prompts[:3]]]
            got += [sched.submit(p, cfg).result(timeout=60) for p in prompts[3:]]
            hits = sched.stats()["prefix_cache_hits"]
        want = [ref.generate(input_ids=[p], config=cfg)[0] for p in prompts]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert hits >= 16
