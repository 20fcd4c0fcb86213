"""``trtinfer.load(DIR)``: an engine = manifest + tokenizer + backend session + generation loop."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import Manifest, read_manifest
from trtinfer.errors import EngineLoadError, InputError
from trtinfer.runtime.config import GenerationConfig, RuntimeConfig, is_int, token_ids
from trtinfer.runtime.forward import Context, Forward, Group, Output, check_capacity
from trtinfer.runtime.forward import execute as execute_passes
from trtinfer.runtime.gen_defaults import read_generation_defaults_and_keys
from trtinfer.runtime.generator import GenerationResult, StreamEvent, warn_length_budget
from trtinfer.runtime.offline import BeamGeneration, Generation
from trtinfer.runtime.scoring import PerplexityResult, ScoreResult, check_ids, score_ids, windowed_perplexity
from trtinfer.runtime.session import Closing, DecoderSession, open_session
from trtinfer.runtime.tokenizer import EngineTokenizer, check_text

log = logging.getLogger(__name__)

_GEN_FIELDS = {f.name for f in dataclasses.fields(GenerationConfig)}
#: keyword options of generate/stream that are callables: ``logits_processor(ids_per_row, logits) -> logits`` (after
#: the model, before repetition penalties and sampling, as transformers' hook) and ``should_stop() -> bool`` (checked
#: once per step; True ends every row with finish_reason "cancelled")
_HOOKS = frozenset({"logits_processor", "should_stop"})


class Engine(Closing):
    """A loaded engine. Generate with :meth:`generate`, stream with :meth:`stream`, score with :meth:`score` and
    :meth:`perplexity`; close or use ``with``."""

    def __init__(self, engine_dir: str | Path, config: RuntimeConfig | None = None) -> None:
        self.path = Path(engine_dir)
        self.manifest: Manifest = read_manifest(self.path)
        self.config = config or RuntimeConfig()
        self.tokenizer = EngineTokenizer(self.path, self.manifest.tokenizer_info)
        self.session: DecoderSession = open_session(self.path, self.manifest, self.config)
        #: defaults of every generate/stream call (the model's generation_config.json over transformers' defaults),
        #: and the fields that file itself set (the rest are transformers' defaults)
        self.generation_defaults, self.generation_defaults_set = read_generation_defaults_and_keys(self.path)
        self.closed = False

    def close(self) -> None:
        """Release the backend session (its weights, buffers and device memory); the engine refuses work after."""
        if not self.closed:
            self.session.close()
            self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise EngineLoadError(f"the engine {self.path} is closed; load it again with trtinfer.load()")

    # ---------------------------------------------------------------------------------------------------------
    def _prompt_ids(self, prompts: Sequence[str] | str | None, input_ids: Sequence[Sequence[int]] | None,
                    chat: bool) -> list[list[int]]:
        if (prompts is None) == (input_ids is None):
            raise InputError("give exactly one of prompts (list of strings) or input_ids (list of token-id lists)")
        if input_ids is not None:
            if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__iter__"):
                raise InputError(f"input_ids must be a list of token-id lists, one per prompt, got "
                                 f"{type(input_ids).__name__}")
            rows = list(input_ids)
            if rows and all(isinstance(t, (int, np.integer)) for t in rows):
                raise InputError("input_ids must be a list of token-id lists, one per prompt: wrap one prompt's ids "
                                 "as [ids]")
            return [token_ids(row, f"input_ids[{i}]") for i, row in enumerate(rows)]
        assert prompts is not None
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, bytes) or not hasattr(prompts, "__iter__"):
            raise InputError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        prompts = list(prompts)  # a generator is read once
        if chat:  # each prompt: one user message (a string) or a conversation (a list of {"role", "content"} dicts)
            return [self.tokenizer.encode_chat(_messages(p, i)) for i, p in enumerate(prompts)]
        if not all(isinstance(p, str) for p in prompts):
            raise InputError("prompts must be strings (with chat=True also lists of messages); pass token ids through "
                             "input_ids=")
        for i, p in enumerate(prompts):
            check_text(p, f"prompt {i}")
        return [self.tokenizer.encode(p) for p in prompts]

    def _generation(self, prompts: Any, input_ids: Any, chat: bool, config: GenerationConfig | None,
                    kwargs: dict[str, Any], streaming: str | None = None) -> Any:
        self._check_open()
        hooks = {k: kwargs.pop(k) for k in _HOOKS if k in kwargs}  # callables, not configuration
        assistant = kwargs.pop("assistant", None)  # an engine, not configuration
        unknown = set(kwargs) - _GEN_FIELDS
        if unknown:
            raise InputError(f"unknown generation option(s) {sorted(unknown)}; known: "
                             f"{sorted(_GEN_FIELDS | _HOOKS | {'assistant'})}")
        if config is not None and not isinstance(config, GenerationConfig):
            raise InputError(f"config must be a GenerationConfig, got {type(config).__name__}")
        if "stop" in kwargs and kwargs["stop"] is None:  # stop=None means no stop strings
            kwargs["stop"] = ()
        # keyword options override the fields of ``config`` (default: the engine's generation_config.json);
        # GenerationConfig checks and normalizes them
        base = config if config is not None else self.generation_defaults
        if (config is None and base.do_sample and "do_sample" not in kwargs
                and is_int(beams := kwargs.get("num_beams", base.num_beams)) and beams > 1):  # else a ConfigError below
            # the model's generation_config.json samples by default (Gemma-3, Llama-3, Qwen ship do_sample=true);
            # asking for beams asks for beam search, which does not sample here
            log.info("num_beams > 1: decoding without sampling (the engine's generation_config.json sets "
                     "do_sample=true; pass do_sample=False to silence this)")
            kwargs["do_sample"] = False
        cfg = dataclasses.replace(base, **kwargs)
        ids = self._prompt_ids(prompts, input_ids, chat)
        warn_length_budget(ids, cfg.max_new_tokens, self.manifest.max_seq_len)
        if cfg.response_format is not None and cfg.num_beams > 1:
            raise InputError("response_format constrains decoding and sampling, not beam search; drop num_beams")
        if assistant is not None and (cfg.num_beams > 1 or cfg.num_return_sequences > 1):
            raise InputError("assistant drafts for one sequence per prompt: it does not combine with num_beams > 1 "
                             "or num_return_sequences > 1")
        if cfg.num_beams > 1:
            if streaming:
                raise InputError("beam search cannot stream: the best hypothesis is known only at the end; use "
                                 "generate()")
            return BeamGeneration(self, ids, cfg, **hooks)
        if cfg.num_return_sequences > 1 and streaming == "one":
            raise InputError("stream() yields one sequence's text; with num_return_sequences > 1 use stream_batch() "
                             "(each event's index names its row: prompt * num_return_sequences + sample) or "
                             "generate()")
        # independent samples: each prompt repeated, each copy its own request and generator
        ids = [row for row in ids for _ in range(cfg.num_return_sequences)]
        return Generation(self, ids, dataclasses.replace(cfg, num_return_sequences=1), assistant=assistant,
                          samples=cfg.num_return_sequences, **hooks)

    def generate(self, prompts: Sequence[str] | str | None = None, *,
                 input_ids: Sequence[Sequence[int]] | None = None, chat: bool = False,
                 config: GenerationConfig | None = None, **kwargs: Any) -> list[GenerationResult]:
        """Generate for a batch of prompts; one :class:`GenerationResult` per prompt, in order.

        Settings come from ``config`` (a :class:`GenerationConfig`) and/or keyword options of the same names
        (``max_new_tokens``, ``min_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``seed``, ``stop``, ...); keywords override ``config``.
        ``chat=True`` renders each prompt as a user message through the model's chat template.
        """
        return self._generation(prompts, input_ids, chat, config, kwargs).run()  # text decoded once per row

    def stream(self, prompt: str | None = None, *, input_ids: Sequence[int] | None = None, chat: bool = False,
               config: GenerationConfig | None = None, **kwargs: Any) -> Iterator[str]:
        """Generate for one prompt, yielding text deltas as tokens arrive; options as for :meth:`generate`."""
        rows = None if input_ids is None else [token_ids(input_ids, "input_ids")]
        if prompt is not None and not isinstance(prompt, str):
            raise InputError(f"stream() takes one prompt (a string), got {type(prompt).__name__}; for a batch use "
                             "stream_batch()")
        prompts = None if prompt is None else [prompt]
        for ev in self._generation(prompts, rows, chat, config, kwargs, streaming="one").events():
            if ev.text:
                yield ev.text

    def stream_batch(self, prompts: Sequence[str] | None = None, *,
                     input_ids: Sequence[Sequence[int]] | None = None, chat: bool = False,
                     config: GenerationConfig | None = None, **kwargs: Any) -> Iterator[StreamEvent]:
        """Generate for a batch, yielding a :class:`StreamEvent` per row per step; options as for :meth:`generate`.

        ``event.index`` is the row: the prompt's index, or with ``num_return_sequences=n`` ``prompt * n + sample``."""
        yield from self._generation(prompts, input_ids, chat, config, kwargs, streaming="batch").events()

    def score(self, prompts: Sequence[str] | str | None = None, *,
              input_ids: Sequence[Sequence[int]] | None = None, chat: bool = False) -> list[ScoreResult]:
        """Score each sequence: one :class:`~trtinfer.runtime.scoring.ScoreResult` per sequence, in order.

        ``result.logprobs[i]`` is log p(token i+1 | tokens 0..i) (float32, length n-1), ``result.argmax[i]`` the
        model's top-1 prediction there, ``result.perplexity = exp(-mean(logprobs))``. Texts are tokenized as for
        :meth:`generate` (special tokens such as BOS included). A sequence longer than the engine's max sequence
        length is an InputError (see :meth:`perplexity` for long texts), as are 1-token sequences (nothing to
        score) and ids outside the vocabulary. Sequences run one at a time, in chunks, whatever the batch limit.
        """
        self._check_open()
        rows = self._prompt_ids(prompts, input_ids, chat)
        if not rows:
            raise InputError("nothing to score: pass at least one text or input_ids row")
        vocab, max_len = int(self.manifest.geometry["vocab_size"]), self.manifest.max_seq_len
        rows = [check_ids(r, vocab, max_len, f"sequence {i}") for i, r in enumerate(rows)]  # all, before any runs
        self.session.check_can_score()
        return [score_ids(self.session, r, what=f"sequence {i}") for i, r in enumerate(rows)]

    def perplexity(self, text: str | None = None, *, input_ids: Sequence[int] | None = None,
                   window: int | None = None, stride: int | None = None,
                   max_tokens: int | None = None) -> PerplexityResult:
        """Perplexity of one text (or token ids) of any length, scored in sliding windows.

        The text is tokenized like ``tokenizer(text)`` (special tokens included); ``max_tokens`` keeps its first
        tokens. Windows of ``window`` tokens (default: the engine's max sequence length) start every ``stride``
        tokens (default ``window // 2``); each scores only tokens no earlier window scored, with up to
        ``window - stride`` tokens of context (see :func:`~trtinfer.runtime.scoring.windowed_perplexity`).
        """
        self._check_open()
        if (text is None) == (input_ids is None):
            raise InputError("give exactly one of text (a string) or input_ids (a list of token ids)")
        if input_ids is None:
            if not isinstance(text, str):
                raise InputError(f"text must be a string, got {type(text).__name__}; pass token ids through input_ids=")
            check_text(text, "the text")
            ids = self.tokenizer.encode(text)
        else:
            ids = token_ids(input_ids, "input_ids")
        if max_tokens is not None:
            if not is_int(max_tokens) or max_tokens < 2:
                raise InputError(f"max_tokens must be at least 2 (the first token has no context), got {max_tokens}")
            ids = ids[:max_tokens]
        return windowed_perplexity(self.session, ids, window, stride)

    def context(self, capacity: int | None = None) -> Context:
        """An empty sequence to feed pass by pass (:mod:`trtinfer.runtime.forward`); ``capacity`` bounds its length
        (default: the engine's max sequence length; buffer layouts allocate that many KV slots)."""
        self._check_open()
        self.session.check_can_score()  # a context's passes read logits at chosen positions
        check_capacity(capacity, self.manifest)
        return Context(self.session, self.manifest.max_seq_len if capacity is None else int(capacity))

    def contexts(self, n: int, capacity: int | None = None) -> list[Context]:
        """``n`` empty sequences whose KV caches are the rows of one batch: :meth:`execute` runs their passes as one
        batched prefill or decode step (see :mod:`trtinfer.runtime.forward`); ``n`` up to the engine's max batch."""
        self._check_open()
        if not (is_int(n) and 1 <= n <= self.manifest.max_batch_size):
            raise InputError(f"contexts(n): n must be within 1..{self.manifest.max_batch_size} (the engine's max "
                             f"batch size), got {n!r}")
        check_capacity(capacity, self.manifest)
        return Group(self.session, int(n), self.manifest.max_seq_len if capacity is None else int(capacity)).contexts

    def execute(self, passes: Sequence[Forward]) -> list[Output]:
        """Run several contexts' passes: one batched step for contexts of one :meth:`contexts` batch that all start
        (in neighbouring rows) or all feed one token; one after another otherwise."""
        self._check_open()
        return execute_passes(passes)

    def describe(self) -> dict[str, Any]:
        """The manifest as a dict."""
        return self.manifest.to_dict()


def _messages(prompt: Any, i: int) -> str | list[dict[str, str]]:
    """A chat prompt checked: a user string, or a list of ``{"role": ..., "content": ...}`` messages."""
    if isinstance(prompt, str):
        check_text(prompt, f"prompt {i}")
        return prompt
    ok = isinstance(prompt, (list, tuple)) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not ok:
        raise InputError(f"chat prompt {i} must be a string or a non-empty list of {{'role': str, 'content': str}} "
                         "messages")
    for j, m in enumerate(prompt):
        check_text(m["content"], f"prompt {i} message {j}")
    return [dict(m) for m in prompt]


def load(engine_dir: str | Path, config: RuntimeConfig | None = None, **overrides: Any) -> Any:
    """Load an engine directory built by ``trtinfer build``; ``overrides`` are :class:`RuntimeConfig` fields.

    Decoder engines give an :class:`Engine` (generate/stream); encoder engines an
    :class:`~trtinfer.runtime.encoder.EncoderEngine` (embed).
    """
    if config is not None and not isinstance(config, RuntimeConfig):
        raise InputError(f"config must be a RuntimeConfig, got {type(config).__name__}; or pass its fields as "
                         "keywords (trtinfer.load(dir, provider='cpu'))")
    if overrides:
        known = {f.name for f in dataclasses.fields(RuntimeConfig)}
        if unknown := sorted(set(overrides) - known):
            raise InputError(f"unknown runtime option(s) {unknown}; known: {sorted(known)}")
        config = dataclasses.replace(config or RuntimeConfig(), **overrides)
    if not isinstance(engine_dir, (str, Path)):
        raise InputError(f"engine_dir must be a path (str or pathlib.Path), got {type(engine_dir).__name__}")
    kind = read_manifest(Path(engine_dir)).kind
    if kind == "encoder":
        from trtinfer.runtime.encoder import EncoderEngine

        return EncoderEngine(engine_dir, config)
    return Engine(engine_dir, config)
