"""Beam search, step for step transformers' ``generate(num_beams=...)``, as a layer over the scheduler's loop.

Each prompt keeps ``num_beams`` running hypotheses. A step scores every continuation of every running beam
(log-softmax of the logits, transformers' processors applied to those log-probabilities, plus the beam's running
score), keeps the best ``2 * num_beams`` (more with several EOS ids), retires candidates that end (an EOS id, or the
prompt's length limit) into the prompt's finished set scored by ``sum of log-probabilities / generated_length **
length_penalty``, and continues the best ``num_beams`` others. A prompt is done by transformers' rule for
``early_stopping`` (``True``: ``num_beams`` finished hypotheses; ``False``: when the best running beam, scored at the
current length, cannot beat the worst finished one; ``"never"``: the same at the longest possible length when
``length_penalty > 0``).

The model runs through the scheduler (:mod:`trtinfer.runtime.scheduler`), as vLLM's beam search runs over its
engine: each step submits one one-token request per running beam (the prompt and the beam's tokens) and reads the
logits it was chosen from. Prefix caching keeps each beam's KV in its row: a beam's first child takes its parent's
row in place, other children copy the parent's prefix into a free row (CPU), and the step's new tokens go as one
batched decode call. Every prompt is independent of the others, as in transformers.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trtinfer.errors import InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.generator import (
    GenerationResult,
    LogitsProcessor,
    Timings,
    check_hooks,
    check_prompts,
    eos_ids,
    run_logits_processor,
)
from trtinfer.runtime.probes import log_softmax
from trtinfer.runtime.request import Finished, Request
from trtinfer.runtime.sampling import apply_processors, top_ids

_NEG = -1.0e9  # transformers' "impossible" score: added, never compared for equality


@dataclass
class _Prompt:
    """One prompt's beam state: running hypotheses (tokens, scores) and the finished set, transformers' tensors."""

    ids: list[int]
    num_beams: int
    limit: int  # most tokens this prompt may generate (max_new_tokens, or up to the engine's max_seq_len)
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False
    cancelled: bool = False

    def __post_init__(self) -> None:
        nb = self.num_beams
        self.running: list[list[int]] = [[] for _ in range(nb)]
        # only the first beam's continuations count at the first step (all beams hold the same prompt)
        self.running_scores = np.array([0.0] + [_NEG] * (nb - 1), np.float32)
        self.finished: list[list[int]] = [[] for _ in range(nb)]
        self.finished_scores = np.full(nb, _NEG, np.float32)
        self.is_finished = np.zeros(nb, bool)


def _length_factor(length: int, penalty: float) -> np.float32:
    """``length ** penalty`` as float32 (inf, not an OverflowError, for an extreme penalty such as 1e300)."""
    with np.errstate(over="ignore"):
        return np.float32(np.power(np.float64(length), penalty))


class BeamSearch:
    """Beam search for a batch of prompts over ``scheduler``; :meth:`run` returns ``num_return_sequences`` results per
    prompt.

    Results come prompt by prompt, each prompt's best hypothesis first; ``result.score`` is transformers'
    ``sequences_scores`` (the length-penalized sum of log-probabilities). ``finish_reason`` is ``"stop"`` for a
    hypothesis that ended with an EOS id, ``"length"`` for one cut by ``max_new_tokens`` or the model length,
    ``"cancelled"`` when ``should_stop`` ended the search. ``logits_processor`` receives each beam's tokens and its
    log-probabilities (transformers applies processors after the log-softmax in beam search).

    ``drive``: step the scheduler in this thread (``engine.generate``); otherwise its own thread runs the requests
    (the server). Prompts run ``max(1, slots // num_beams)`` at a time, so a step's beams all hold a row.
    """

    def __init__(self, scheduler: Any, prompts: Sequence[Sequence[int]], cfg: GenerationConfig, *, drive: bool,
                 logits_processor: LogitsProcessor | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        vocab = scheduler.vocab
        slots = scheduler.cache.slots
        if cfg.num_beams > slots:
            raise InputError(f"num_beams={cfg.num_beams} exceeds the {slots} sequences that run at once (the engine's "
                             "max batch size, or the server's --max-slots; each beam is a row of the batch); lower "
                             "num_beams or rebuild with a larger --max-batch-size")
        if cfg.num_beams * 2 > vocab:
            raise InputError(f"num_beams={cfg.num_beams} needs at least {2 * cfg.num_beams} tokens in the vocabulary")
        self.sched, self.cfg, self.drive = scheduler, cfg, drive
        self.tok, self.max_seq_len = scheduler.tokenizer, scheduler.max_seq_len
        self.prompts = check_prompts(prompts, vocab, self.max_seq_len)
        self.per_group = max(1, slots // cfg.num_beams)
        self.eos = eos_ids(cfg, self.tok, vocab)
        self.logits_processor, self.should_stop = check_hooks(logits_processor, should_stop)
        # each beam's step: its next token's logits, nothing else (no stop rules, no text)
        self._one = GenerationConfig(max_new_tokens=1, do_sample=False, ignore_eos=True)

    def run(self) -> list[GenerationResult]:
        return [r for start in range(0, len(self.prompts), self.per_group)
                for r in self._search(self.prompts[start:start + self.per_group])]

    def _logits(self, seqs: list[list[int]], continuations: bool = True) -> np.ndarray:
        """The next-token logits ``[len(seqs), V]`` after each sequence, one one-token request each; a beam's
        ``continuations`` reuse their parent's row whatever its length (the prompts themselves take the usual
        prefix floor, so prompts that share only a BOS token still prefill together)."""
        reqs: list[Request] = []
        try:  # one request: the prompts face the queue limit, an admitted search's later steps do not
            reqs = self.sched.submit_all([(seq, self._one) for seq in seqs], queue_limit=not continuations,
                                         text=False, keep_logits=True, internal=True,
                                         **({"min_reuse": 1, "decode_tail": True} if continuations else {}))
            if self.drive:
                while not all(r.done for r in reqs):
                    self.sched.step()
            rows = []
            for r in reqs:
                r.result()  # raises a request's failure
                assert r.last_logits is not None
                rows.append(r.last_logits)
        except BaseException:
            for r in reqs:  # a failed submission or request: the step's other requests go too
                r.cancel()
            raise
        return np.stack(rows)

    def _search(self, prompts: list[list[int]]) -> list[GenerationResult]:
        cfg, nb = self.cfg, self.cfg.num_beams
        states = [_Prompt(p, nb, min(cfg.max_new_tokens, self.max_seq_len - len(p))) for p in prompts]
        keep_k = max(2, 1 + len(self.eos)) * nb  # candidates kept per prompt (transformers' beams_to_keep)
        t_submit = time.perf_counter()
        step_ends: list[list[float]] = [[] for _ in prompts]  # per prompt: when each of its steps ended
        reasons = ["error"] * len(prompts)
        try:
            self._steps(prompts, states, keep_k, step_ends)
            results = [r for p, st, ends in zip(prompts, states, step_ends)
                       for r in self._results(st, Timings.of_steps(len(p), len(prompts) * nb, t_submit, ends))]
            reasons = [self._reason(st, st.finished[0]) if st.finished else "length" for st in states]  # best beam's
        finally:  # its step requests are internal: the search is the request the scheduler counts
            for p, reason, ends in zip(prompts, reasons, step_ends):
                end = ends[-1] if ends and reason != "error" else time.perf_counter()  # a failure: when it failed
                self.sched.report(Finished(reason, len(p), t_submit, ends[0] if ends else None, tuple(ends), end))
        return results

    def _steps(self, prompts: list[list[int]], states: list[_Prompt], keep_k: int,
               step_ends: list[list[float]]) -> None:
        cfg, nb = self.cfg, self.cfg.num_beams
        logits = np.repeat(self._logits(prompts, continuations=False), nb, axis=0)  # every beam starts as its prompt
        active = list(range(len(prompts)))  # prompts whose beams run, in order
        step = 0
        while True:
            seen = [np.asarray(states[i].ids + beam, np.int64) for i in active for beam in states[i].running]
            scores = apply_processors(log_softmax(logits, np.float32), cfg, seen, step, self.eos)
            if self.logits_processor is not None:
                scores = run_logits_processor(self.logits_processor, seen, scores)
            cancelled = self.should_stop is not None and bool(self.should_stop())
            parents: list[tuple[int, int]] = []  # each next beam's parent: (prompt, beam), its KV in a row
            for slot, i in enumerate(active):
                src = self._step(states[i], scores[slot * nb:(slot + 1) * nb], step, keep_k, cancelled)
                if not states[i].done:
                    parents.extend((i, b) for b in src)
            now = time.perf_counter()
            for i in active:
                step_ends[i].append(now)
            step += 1
            active = [i for i in active if not states[i].done]
            if not active:
                break
            seqs = [states[i].ids + beam for i in active for beam in states[i].running]
            # each parent's first child first: it takes the parent's row in place before a sibling's copy evicts
            # anything (the rows of beams that died are the ones reused)
            order = sorted(range(len(seqs)), key=lambda j: parents.index(parents[j]) != j)
            logits = self._logits([seqs[j] for j in order])[np.argsort(order)]  # back in the beams' order

    def _step(self, st: _Prompt, scores: np.ndarray, step: int, keep_k: int,
              cancelled: bool) -> list[int]:
        """One step of one prompt (transformers' ``_beam_search`` body); returns the next running beams' parents
        (indices into the previous running beams).
        ``scores [num_beams, V]``: processed log-probabilities of each running beam's continuations."""
        nb, lp, vocab = st.num_beams, self.cfg.length_penalty, scores.shape[-1]
        total = scores + st.running_scores[:, None]
        # the best keep_k of all beams' continuations are among each beam's own best keep_k (a partial selection per
        # row, not over num_beams * V), then ordered best first (equal scores: lower beam, then lower token first)
        cand = top_ids(total, keep_k)
        vals = np.take_along_axis(total, cand, -1).reshape(-1)
        flat = (np.arange(nb)[:, None] * vocab + cand).reshape(-1)
        order = np.lexsort((flat, -vals))[:keep_k]
        top, top_scores = flat[order], vals[order].astype(np.float32)
        beam, token = top // vocab, top % vocab
        gen_len = step + 1  # tokens generated by every candidate, its new one included
        ends = np.isin(token, list(self.eos)) | (gen_len >= st.limit) | cancelled
        candidates = [st.running[b] + [int(t)] for b, t in zip(beam, token)]
        # the best num_beams candidates that go on (ended ones pushed to the bottom)
        go_on = top_scores + ends.astype(np.float32) * np.float32(_NEG)
        nxt = np.argsort(-go_on, kind="stable")[:nb]
        # the finished set takes the ended candidates among the top num_beams, if they beat what it holds
        just_ended = ends & (np.arange(keep_k) < nb)
        final = top_scores / _length_factor(gen_len, lp)
        if self.cfg.early_stopping is True and st.is_finished.all():
            final = final + np.float32(_NEG)
        if not st.improvable:
            final = final + np.float32(_NEG)
        final = final + (~just_ended).astype(np.float32) * np.float32(_NEG)
        merged = np.concatenate([st.finished_scores, final])
        best = np.argsort(-merged, kind="stable")[:nb]
        pool = st.finished + candidates
        flags = np.concatenate([st.is_finished, just_ended])
        st.finished, st.finished_scores, st.is_finished = [pool[j] for j in best], merged[best], flags[best]
        st.running, st.running_scores = [candidates[j] for j in nxt], go_on[nxt]
        st.cancelled = st.cancelled or cancelled
        # transformers' stopping rules, at the new length
        best_len = st.limit if self.cfg.early_stopping == "never" and lp > 0.0 else gen_len
        best_running = st.running_scores[0] / _length_factor(best_len, lp)
        worst = np.where(st.is_finished, st.finished_scores.min(), np.float32(_NEG))
        st.improvable = st.improvable and bool((best_running > worst).any())
        all_full = bool(st.is_finished.all()) and self.cfg.early_stopping is True
        st.done = not st.improvable or all_full or bool(ends.all())
        return [int(beam[j]) for j in nxt]

    def _reason(self, st: _Prompt, tokens: list[int]) -> str:
        return "stop" if tokens and tokens[-1] in self.eos else ("cancelled" if st.cancelled else "length")

    def _results(self, st: _Prompt, timings: Timings) -> list[GenerationResult]:
        out = []
        for tokens, score in list(zip(st.finished, st.finished_scores))[:self.cfg.num_return_sequences]:
            reason = self._reason(st, tokens)
            out.append(GenerationResult(list(tokens), self.tok.decode(tokens), reason, list(st.ids), timings,
                                        tokens[-1] if reason == "stop" else None, score=float(score)))
        return out
