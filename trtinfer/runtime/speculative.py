"""Prompt-lookup decoding (transformers' ``prompt_lookup_num_tokens``): drafts copied from the sequence itself,
verified by the model in one pass.

Each step looks up the sequence's last ``n`` tokens (``n`` from ``max_matching_ngram_size`` down to 1) at their
first earlier occurrence in prompt + output, takes up to ``prompt_lookup_num_tokens`` tokens that followed it as a
draft, and feeds the last token and the draft in one pass, reading the logits at every position. The model's choice
at each position is made exactly as plain decoding would make it there (penalties and min_new_tokens, the user's
``logits_processor``, then argmax or one draw from the row's generator); the draft's tokens are kept while
they equal those choices, and the first choice that differs ends the step (it is the model's own next token, as
transformers' "bonus" token). Rejected draft tokens are rolled back from the KV cache. Where nothing matches, a step
is a plain one-token decode.

So greedy output is token for token plain greedy's, and sampling with a ``seed`` draws the same tokens as plain
sampling with that seed (one uniform per kept token, from the same per-prompt generator), except where float
rounding differs between a several-token pass and a one-token pass at a near tie. (transformers samples every
position of the pass and keeps the matching prefix: the same distribution, other draws.) On an fp32 engine those
differences are ~1e-5; quantized engines whose MatMulNBits quantize activations (``accuracy_level`` 4) run other
kernels for one row than for several, and SmolLM2-135M int4's logits then differ by up to ~0.6, so its output can
leave plain greedy's at a top-two gap of that size (as plain greedy's own prefill and decode steps differ).

Cost: a pass of ``K + 1`` tokens costs more than a one-token step (SmolLM2-135M on 2 CPU cores: fp32 ~1.4x for 11
tokens, int4 ~4x), so drafts pay where they are mostly accepted: text that copies its context.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass
from functools import partial

import numpy as np

from trtinfer.errors import ConfigError, InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.forward import Context
from trtinfer.runtime.generator import (
    Generation,
    GenerationResult,
    LogitsProcessor,
    StreamEvent,
    Timings,
    TokenLogprob,
    row_finish,
    settle,
    token_logprobs,
    user_hook,
)
from trtinfer.runtime.ngram import NgramIndex
from trtinfer.runtime.probes import Argmax, Logits
from trtinfer.runtime.sampling import banned_ngram_tokens, is_plain_greedy, select_next
from trtinfer.runtime.session import DecoderSession
from trtinfer.runtime.tokenizer import EngineTokenizer, IncrementalDecoder

log = logging.getLogger(__name__)


@dataclass
class LookupStats:
    """One prompt's drafting: model passes after the prefill, draft tokens proposed, and how many of them the
    model agreed with and were kept (each step also keeps the model's own next token, not counted here)."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict[str, float | int]:
        """JSON-friendly summary."""
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": round(self.acceptance_rate, 4)}


class PromptLookupGeneration(Generation):
    """:class:`~trtinfer.runtime.generator.Generation` with prompt-lookup drafts: the same results, fewer passes
    on text that repeats its context (quoting, editing code, extraction).

    Prompts run one after another, each alone (batch 1), as transformers' assisted decoding supports batch 1 only:
    each row's accepted draft length differs, so a batch would pad to its slowest row. :attr:`stats` holds each
    prompt's :class:`LookupStats`. Per result, ``timings.batch_size`` is 1, ``prefill_ms`` is the prompt's pass and
    first token, and ``decode_ms`` has one entry per later token: a pass's time split evenly over the tokens it kept.
    ``max_time`` and ``should_stop`` are checked after each pass: the tokens that pass kept stay, and prompts not
    started yet get their first token only (as every row of a plain batch has at least one). Drafts stop before an
    EOS id (transformers' rule; the model then picks EOS itself where it would) and before a token
    ``no_repeat_ngram_size`` bans; they never reach past ``max_new_tokens`` or the engine's ``max_seq_len``.

    Needs an engine whose graph returns logits at chosen positions (built by current trtinfer: the
    ``logits_positions`` input); every KV layout works (rejected tokens are rolled back with ``truncate_cache``).
    """

    drafting = "prompt_lookup_num_tokens"  # what drafts, as error messages name it

    def __init__(self, session: DecoderSession, tokenizer: EngineTokenizer, prompts: Sequence[Sequence[int]],
                 cfg: GenerationConfig, max_batch_size: int, max_seq_len: int, *,
                 logits_processor: LogitsProcessor | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        self._check_drafting(cfg)
        super().__init__(session, tokenizer, prompts, cfg, max_batch_size, max_seq_len,
                         logits_processor=logits_processor, should_stop=should_stop)
        try:
            session.check_can_score()
        except InputError as e:
            raise InputError(f"{self.drafting} needs logits at several positions per pass, but this engine's graph "
                             "computes them at the last position only (no logits_positions input: an older trtinfer "
                             f"build or that pass disabled); rebuild the engine, or generate without {self.drafting}"
                             ) from e
        self.stats: list[LookupStats] = []
        self._halt: str | None = None

    def _check_drafting(self, cfg: GenerationConfig) -> None:
        if cfg.prompt_lookup_num_tokens is None:
            raise ConfigError("PromptLookupGeneration needs prompt_lookup_num_tokens (a positive integer); use "
                              "Generation for plain decoding", field="prompt_lookup_num_tokens")

    def _steps(self, deltas: bool) -> Iterator[StreamEvent]:
        """Each prompt in turn: prefill, then draft-and-verify passes; one event per kept token when ``deltas``."""
        cfg, n = self.cfg, len(self.prompts)
        seeds = np.random.SeedSequence(cfg.seed).spawn(n) if cfg.do_sample else []  # as Generation: one per prompt
        self.stats = [LookupStats() for _ in range(n)]
        self._halt = None
        deadline = None if cfg.max_time is None else time.perf_counter() + cfg.max_time
        results = []
        for i in range(n):
            rng = np.random.default_rng(seeds[i]) if seeds else None
            results.append((yield from self._row(i, rng, deadline, deltas)))
        self.results = results

    def _check_halt(self, deadline: float | None) -> str | None:
        """``"length"`` past ``max_time``, ``"cancelled"`` once ``should_stop`` says so; it stays for later rows."""
        if self._halt is None:
            if deadline is not None and time.perf_counter() > deadline:
                self._halt = "length"
            elif self.should_stop is not None and self.should_stop():
                self._halt = "cancelled"
        return self._halt

    def _row(self, i: int, rng: np.random.Generator | None, deadline: float | None,
             deltas: bool) -> PyGenerator[StreamEvent, None, GenerationResult]:
        """Generate prompt ``i`` alone; yields its events, returns its result."""
        cfg, prompt, stats = self.cfg, self.prompts[i], self.stats[i]
        k = int(cfg.prompt_lookup_num_tokens or 0)
        limit = min(len(prompt) + cfg.max_new_tokens, self.max_seq_len)  # the row's longest prompt + output
        # as Generation's for a batch of one: KV room for every token the row may feed (its last is never fed)
        ctx = Context(self.session, min(self.max_seq_len, len(prompt) + cfg.max_new_tokens + 1))
        index = NgramIndex(cfg.max_matching_ngram_size)
        index.extend(prompt)
        seq = index.tokens  # prompt + generated so far
        generated: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if cfg.logprobs else None
        dec = IncrementalDecoder(self.tok, cfg.stop) if deltas or cfg.stop else None
        timings = Timings(prompt_tokens=len(prompt), batch_size=1)
        finish: str | None = None
        stop_reason: str | int | None = None
        fed, first = list(prompt), True
        draft: list[int] = []
        t0 = time.perf_counter()
        while True:
            chosen, items = self._verify(ctx, fed, draft, list(seq), len(generated), rng)
            elapsed = (time.perf_counter() - t0) * 1000.0
            halt = self._check_halt(deadline)
            kept = 0
            for j, tok in enumerate(chosen):
                kept = j + 1
                generated.append(tok)
                index.extend([tok])
                if logprobs is not None:
                    logprobs.append(items[j])
                delta = dec.add(tok) if dec is not None else ""
                # limit = min(prompt + max_new_tokens, max_seq_len): the length rule of row_finish, in one number
                finish, stop_reason = row_finish(tok, dec, self.eos, len(seq), len(seq), limit, limit,
                                                 halt if j == len(chosen) - 1 else None)
                if finish is not None:
                    tail, finish, stop_reason = settle(dec, finish, stop_reason)
                    delta += tail
                if deltas:
                    yield StreamEvent(i, delta, tok, finish)
                if finish is not None:
                    break
            if first:  # the prompt's pass: its one token is the first, timed as plain generation's prefill
                timings.prefill_ms, first = elapsed, False
            else:
                stats.passes += 1
                stats.drafted += len(draft)
                stats.accepted += min(kept, len(chosen) - 1)  # chosen = the matching draft tokens + the model's next
                timings.decode_ms.extend([elapsed / kept] * kept)
            if finish is not None:
                break
            t0 = time.perf_counter()
            if len(ctx) > len(seq) - 1:  # the rejected draft tokens' keys and values go
                ctx.truncate(len(seq) - 1)
            draft = self._draft(index, k, limit)
            fed = [seq[-1], *draft]
        ctx.release()  # its KV buffers go now, not with the generation object
        log.debug("prompt lookup, prompt %d: %d passes, %d draft tokens, %d accepted, %d generated", i,
                  stats.passes, stats.drafted, stats.accepted, len(generated))
        text = dec.text if dec is not None else self.tok.decode(generated)
        return GenerationResult(generated, text, finish, prompt, timings, stop_reason, logprobs)

    def _draft(self, index: NgramIndex, k: int, limit: int) -> list[int]:
        """The next draft: the lookup, cut so the step's tokens stay within ``limit``, before the first EOS and
        before the first token no_repeat_ngram_size bans (those drafts could only be rejected)."""
        seq = index.tokens
        return self._trim(index.draft(min(k, limit - len(seq) - 1)), seq)  # + one token of the model's: <= limit

    def _trim(self, draft: list[int], seq: list[int]) -> list[int]:
        """``draft`` up to its first EOS id or first token no_repeat_ngram_size bans after ``seq``."""
        for j, t in enumerate(draft):
            if t in self.eos:
                draft = draft[:j]
                break
        n = self.cfg.no_repeat_ngram_size
        if n > 0:
            for j, t in enumerate(draft):
                if t in banned_ngram_tokens(np.asarray(seq + draft[:j], dtype=np.int64), n):
                    return draft[:j]
        return draft

    def _verify(self, ctx: Context, fed: list[int], draft: list[int], seq: list[int], n_generated: int,
                rng: np.random.Generator | None) -> tuple[list[int], list[TokenLogprob]]:
        """One pass over ``fed`` (the prompt, or the last token + ``draft``); the model's choices at the draft's
        positions while they equal the draft, then its first differing (or next) choice, and their logprobs.

        ``seq`` is prompt + generated so far, its last token fed in this pass.
        """
        cfg, d = self.cfg, len(draft)
        positions = list(range(len(fed) - d - 1, len(fed)))  # where each draft token (and the next one) is chosen
        fwd = ctx.forward().input(fed)
        if is_plain_greedy(cfg) and self.logits_processor is None:  # the argmax, nothing else to apply
            handles = fwd.sample(positions, Argmax())
            out = fwd.execute()
            chosen = [out.token(h) for h in handles]
            m = 0
            while m < d and chosen[m] == draft[m]:
                m += 1
            return chosen[:m + 1], []
        probes = [fwd.probe(p, Logits()) for p in positions]
        out = fwd.execute()
        tokens: list[int] = []
        items: list[TokenLogprob] = []
        for j, h in enumerate(probes):
            logits = out.logits(h)[None, :]
            seen = [np.asarray(seq + draft[:j], dtype=np.int64)]
            # the user's processor runs after the built-in ones, before the warpers (transformers' order)
            hook = None if self.logits_processor is None else partial(user_hook, self.logits_processor, seen)
            tok = int(select_next(logits, cfg, seen, n_generated + j, self.eos, [rng] if rng is not None else [],
                                  hook=hook)[0])
            tokens.append(tok)
            if cfg.logprobs:
                items.extend(token_logprobs(logits, np.array([tok]), cfg.top_logprobs))
            if j == d or tok != draft[j]:
                break
        return tokens, items
