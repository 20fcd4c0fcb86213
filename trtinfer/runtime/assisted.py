"""Assisted decoding (transformers' ``assistant_model``): a smaller or quantized engine of the same vocabulary drafts
tokens greedily, the engine verifies them in one pass.

The verification, rollback, sampling rule, stop rules and timings are prompt lookup's
(:class:`~trtinfer.runtime.speculative.PromptLookupGeneration`): greedy output is token for token the engine's own
plain greedy output, and seeded sampling draws plain sampling's tokens. Only the drafts differ: the assistant keeps
its own KV cache of the sequence, rolled back to the part the engine kept after each step, and proposes
``num_assistant_tokens`` tokens by argmax, one pass per token (the first pass also feeds the tokens the engine added).
With ``num_assistant_tokens_schedule="heuristic"`` (transformers') the draft length grows by 2 after a draft the
engine took whole and shrinks by 1 (to at least 1) otherwise.

A quantized engine of the same model is a natural assistant: ``trtinfer build M --precision int4`` drafts for the
fp32 engine of ``M``, whose output stays the fp32 engine's.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from trtinfer.errors import InputError
from trtinfer.runtime.config import GenerationConfig
from trtinfer.runtime.forward import Context
from trtinfer.runtime.generator import LogitsProcessor, StreamEvent
from trtinfer.runtime.ngram import NgramIndex
from trtinfer.runtime.probes import Argmax
from trtinfer.runtime.session import DecoderSession
from trtinfer.runtime.speculative import PromptLookupGeneration
from trtinfer.runtime.tokenizer import EngineTokenizer

log = logging.getLogger(__name__)


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


class AssistedGeneration(PromptLookupGeneration):
    """Prompt lookup's verify-and-roll-back loop with drafts from ``assistant`` (an :class:`~trtinfer.Engine`).

    Prompts run one after another, each alone, as transformers' assisted decoding does. :attr:`stats` holds each
    prompt's passes of the engine, drafted and accepted tokens (:class:`~trtinfer.runtime.speculative.LookupStats`).
    """

    drafting = "assistant"

    def __init__(self, session: DecoderSession, tokenizer: EngineTokenizer, prompts: Sequence[Sequence[int]],
                 cfg: GenerationConfig, max_batch_size: int, max_seq_len: int, *, assistant: Any,
                 logits_processor: LogitsProcessor | None = None, should_stop: Callable[[], bool] | None = None) -> None:
        check_assistant(assistant, tokenizer, int(session.manifest.geometry["vocab_size"]))
        super().__init__(session, tokenizer, prompts, cfg, max_batch_size, max_seq_len,
                         logits_processor=logits_processor, should_stop=should_stop)
        self.assistant = assistant
        self._index: NgramIndex | None = None  # the row being drafted for
        self._ctx: Context | None = None  # the assistant's KV of that row (ctx.tokens: the tokens it holds)
        self._last: tuple[int, list[int]] = (0, [])  # the previous draft and the sequence length it followed
        self._k = cfg.num_assistant_tokens

    def _steps(self, deltas: bool) -> Iterator[StreamEvent]:
        try:
            yield from super()._steps(deltas)
        finally:  # the assistant's KV buffers go with the generation (on a GPU: device memory)
            if self._ctx is not None:
                self._ctx.release()
            self._ctx, self._index = None, None

    def _check_drafting(self, cfg: GenerationConfig) -> None:
        if cfg.prompt_lookup_num_tokens is not None:
            raise InputError("assistant and prompt_lookup_num_tokens are two ways of drafting; give one of them")

    def _draft(self, index: NgramIndex, k: int, limit: int) -> list[int]:
        seq = index.tokens
        if index is not self._index:  # a new prompt: a fresh assistant cache, the draft length from the config
            self._index, self._last, self._k = index, (0, []), self.cfg.num_assistant_tokens
            if self._ctx is not None:
                self._ctx.release()
            a_max = self.assistant.session.manifest.max_seq_len
            self._ctx = Context(self.assistant.session, max(2, min(a_max, limit)))
        else:
            self._adapt(seq)
        ctx = self._ctx
        assert ctx is not None
        held = ctx.tokens
        keep = 0  # the assistant's tokens still in the sequence
        while keep < min(len(held), len(seq)) and held[keep] == seq[keep]:
            keep += 1
        keep = min(keep, len(seq) - 1)  # at least the last token is fed, to read the next one's logits
        if len(ctx) > keep:
            ctx.truncate(keep)
        want = min(self._k, limit - len(seq) - 1, ctx.capacity - len(seq))  # the engine adds its own token after
        draft: list[int] = []
        pending = seq[keep:]
        while len(draft) < max(want, 0):
            fwd = ctx.forward().input(pending)
            handle = fwd.sample(len(pending) - 1, Argmax())[0]  # the last fed token's next
            tok = fwd.execute().token(handle)
            draft.append(tok)
            if tok in self.eos:
                break
            pending = [tok]
        draft = self._trim(draft, seq)
        self._last = (len(seq), draft)
        return draft

    def _adapt(self, seq: list[int]) -> None:
        """transformers' heuristic: +2 after a draft the engine kept whole, -1 (down to 1) otherwise."""
        at, last = self._last
        if not last or self.cfg.num_assistant_tokens_schedule == "constant":
            return
        kept = seq[at:at + len(last)] == last
        self._k = self._k + 2 if kept else max(1, self._k - 1)
