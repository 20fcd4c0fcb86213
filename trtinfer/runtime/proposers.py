"""Draft proposers of speculative decoding, verified by the scheduler (:mod:`trtinfer.runtime.scheduler`).

A proposer suggests the next tokens of one request's sequence; the scheduler feeds the request's token and the
draft in one pass, keeps the draft while the model's own choices (made exactly as a decode step makes them) equal
it, then the model's first differing choice, and rolls the row back to what was kept. So greedy output is token for
token plain greedy's, and seeded sampling draws plain sampling's tokens (one uniform per kept token from the
request's generator), except where float rounding differs between a several-token pass and a one-token pass at a
near tie. On an fp32 engine those differences are ~1e-5; quantized engines whose MatMulNBits quantize activations
(``accuracy_level`` 4) run other kernels for one row than for several, and SmolLM2-135M int4's logits then differ by
up to ~0.6, so its output can leave plain greedy's at a top-two gap of that size.

- :class:`NgramProposer`: prompt lookup (transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram`` method), drafts
  copied from the sequence itself.
- :class:`AssistantProposer`: assisted decoding (transformers' ``assistant_model``), drafts from a smaller or
  quantized engine of the same vocabulary, by argmax, one pass per token on its own KV cache of the sequence.

Cost: a pass of ``K + 1`` tokens costs more than a one-token step (SmolLM2-135M on 2 CPU cores: fp32 ~1.4x for 11
tokens, int4 ~4x), so drafts pay where they are mostly accepted: text that copies its context, or an assistant that
mostly agrees.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

import numpy as np

from trtinfer.errors import InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.forward import Context
from trtinfer.runtime.prefix_cache import common_prefix
from trtinfer.runtime.probes import Argmax
from trtinfer.runtime.sampling import banned_ngram_tokens
from trtinfer.runtime.session import DecoderSession
from trtinfer.runtime.tokenizer import EngineTokenizer


class Proposer(Protocol):
    """Drafts for one request."""

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``seq`` (prompt + generated so far)."""

    def close(self) -> None:
        """Release what the proposer holds (an assistant's KV buffers)."""


def trim_draft(draft: list[int], seq: Sequence[int], eos: Collection[int], no_repeat_ngram_size: int) -> list[int]:
    """``draft`` up to its first EOS id (transformers' rule: the model then picks EOS itself where it would) or its
    first token that ``no_repeat_ngram_size`` bans after ``seq`` (such tokens could only be rejected)."""
    draft = draft[:next((j for j, t in enumerate(draft) if t in eos), len(draft))]
    if no_repeat_ngram_size > 0:
        for j, t in enumerate(draft):
            if t in banned_ngram_tokens(np.asarray([*seq, *draft[:j]], dtype=np.int64), no_repeat_ngram_size):
                return draft[:j]
    return draft


class NgramIndex:
    """A growing token sequence and the first occurrence of each of its n-grams, ``n = 1..max_n``.

    :meth:`draft` is transformers' ``PromptLookupCandidateGenerator`` lookup: for ``n`` from ``max_n`` (at most
    ``len - 1``) down to 1, the leftmost earlier occurrence of the last ``n`` tokens, and the up to ``k`` tokens that
    follow it. A leftmost occurrence never moves as the sequence grows, so a dict answers in O(max_n) per step.
    """

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._first: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens, registering the n-grams that end at each."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self._first.setdefault(tuple(self.tokens[end - n:end]), end - n)

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens after the leftmost earlier occurrence of the longest matching suffix ([] if none)."""
        seq, size = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, size - 1), 0, -1):
            at = self._first.get(tuple(seq[size - n:]))
            if at is not None and at < size - n:  # an occurrence before the suffix itself: it has a continuation
                return seq[at + n:at + n + max(k, 0)]
        return []


class NgramProposer:
    """Prompt lookup: the n-gram lookup over the request's sequence, ``prompt_lookup_num_tokens`` at most."""

    def __init__(self, cfg: GenerationConfig) -> None:
        self.k = int(cfg.prompt_lookup_num_tokens or 0)
        self.index = NgramIndex(cfg.max_matching_ngram_size)

    def propose(self, seq: list[int], k: int) -> list[int]:
        self.index.extend(seq[len(self.index.tokens):])  # the sequence only grows between calls
        return self.index.draft(min(self.k, k))

    def close(self) -> None:
        pass


def check_assistant(assistant: Any, tokenizer: EngineTokenizer, vocab_size: int) -> None:
    """One line unless ``assistant`` is an open decoder engine whose tokenizer maps tokens to the same ids."""
    session = getattr(assistant, "session", None)
    if not isinstance(session, DecoderSession) or not hasattr(assistant, "tokenizer"):
        raise InputError(f"assistant must be a decoder Engine (trtinfer.load(DIR)), got {type(assistant).__name__}")
    if getattr(assistant, "closed", False):
        raise InputError("the assistant engine is closed; load it again with trtinfer.load()")
    try:
        session.check_can_score()
    except InputError as e:
        raise InputError("the assistant engine computes logits at the last position only (built by an older trtinfer "
                         "or with that pass disabled); rebuild it with `trtinfer build`") from e
    mine = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    theirs = assistant.tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    if mine != theirs:
        raise InputError(f"the assistant's vocabulary differs from this engine's ({len(theirs)} vs {len(mine)} "
                         "tokens, or other ids): assisted decoding needs an engine of the same tokenizer, e.g. a "
                         "quantized build of the same model")
    size = int(session.manifest.geometry["vocab_size"])
    if size != vocab_size:
        raise InputError(f"the assistant's model has {size} output ids and this engine's {vocab_size}: assisted "
                         "decoding needs the same vocabulary, e.g. a quantized build of the same model")


class AssistantProposer:
    """Assisted decoding: ``assistant`` (an :class:`~trtinfer.Engine`) keeps its own KV cache of the request's
    sequence, rolled back to the part the engine kept after each step, and drafts ``num_assistant_tokens`` tokens by
    argmax, one pass per token (the first pass also feeds the tokens the engine added since). With
    ``num_assistant_tokens_schedule="heuristic"`` (transformers') the draft length grows by 2 after a draft the engine
    took whole and shrinks by 1 (to at least 1) otherwise. A quantized build of the same model is a natural
    assistant: ``trtinfer build M --precision int4`` drafts for the fp32 engine of ``M``, whose output stays the fp32
    engine's."""

    def __init__(self, assistant: Any, cfg: GenerationConfig, eos: Collection[int], limit: int) -> None:
        self.cfg, self.eos = cfg, eos
        self.k = cfg.num_assistant_tokens
        self.ctx = Context(assistant.session, max(2, min(assistant.session.manifest.max_seq_len, limit)))
        self._last: tuple[int, list[int]] = (0, [])  # the previous draft and the sequence length it followed

    def propose(self, seq: list[int], k: int) -> list[int]:
        # transformers' heuristic: +2 after a draft the engine kept whole, -1 (down to 1) otherwise
        at, last = self._last
        if last and self.cfg.num_assistant_tokens_schedule != "constant":
            self.k = self.k + 2 if seq[at:at + len(last)] == last else max(1, self.k - 1)
        ctx = self.ctx
        # the assistant's tokens still in the sequence, less at least the last one: it is fed, to read the next logits
        keep = min(common_prefix(ctx.tokens, seq), len(seq) - 1)
        if len(ctx) > keep:
            ctx.truncate(keep)
        want = min(self.k, k, ctx.capacity - len(seq))
        draft: list[int] = []
        pending = seq[keep:]
        while len(draft) < want:
            fwd = ctx.forward().input(pending)
            handle = fwd.sample(len(pending) - 1, Argmax())[0]  # the last fed token's next
            tok = fwd.execute().token(handle)
            draft.append(tok)
            if tok in self.eos:
                break
            pending = [tok]
        self._last = (len(seq), draft)
        return draft

    def close(self) -> None:
        """The assistant's KV buffers go with the request (on a GPU: device memory)."""
        self.ctx.release()
