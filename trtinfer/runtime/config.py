"""Runtime and generation configuration (frozen, validated)."""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any

from trtinfer.errors import ConfigError, InputError

PROVIDERS = ("cpu", "cuda", "tensorrt")
GPU_PROVIDERS = ("cuda", "tensorrt")  # ONNX Runtime providers that keep the KV cache on a CUDA device


def describe(value: Any) -> str:
    """``2.5 (float)``: the value and its type, for "expected X, got Y" messages."""
    text = repr(value)
    return f"{text[:60]}... ({type(value).__name__})" if len(text) > 60 else f"{text} ({type(value).__name__})"


#: temperatures below this sample greedily (vLLM's rule; the server's temperature 0 is greedy too)
GREEDY_BELOW = 1e-5


def is_int(value: Any) -> bool:
    # numbers.Integral takes numpy ints too; True is an int to Python, not to a user
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def token_ids(row: Any, what: str, vocab: int | None = None) -> list[int]:
    """``row`` as a list of token ids: InputError naming ``what`` unless it is a list, tuple or 1-D array of integers
    (a float, a bool or a string is refused, not rounded or read as an id), each within ``[0, vocab)`` when given.
    The one check of token ids every entry point (prompts, scoring, contexts, probes, the server) makes."""
    if isinstance(row, (str, bytes)) or not hasattr(row, "__len__") or getattr(row, "ndim", 1) != 1:
        raise InputError(f"{what} must be a list of token ids (ints), got {type(row).__name__}")
    for t in row:
        if not is_int(t):
            raise InputError(f"{what} must hold integer token ids, got {t!r} ({type(t).__name__})")
    ids = [int(t) for t in row]
    if vocab is not None and (bad := [t for t in ids if not 0 <= t < vocab]):
        raise InputError(f"{what} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return ids


#: the check of a field annotated with each of these types, and what its message says is expected
_KINDS = {"int": (is_int, "an integer"), "float": (is_number, "a finite number"),
          "bool": (lambda v: isinstance(v, bool), "True or False")}


def _check_types(obj: Any) -> None:
    """Raise ConfigError for the first field of dataclass ``obj`` annotated ``int``, ``float`` or ``bool`` whose value
    is not of that kind (fields of other types, ``int | None`` included, are checked by their owner)."""
    for f in dataclasses.fields(obj):
        if f.type in _KINDS:
            ok, expected = _KINDS[f.type]
            if not ok(value := getattr(obj, f.name)):
                raise ConfigError(f"{f.name} must be {expected}, got {describe(value)}", field=f.name)


@dataclass(frozen=True)
class RuntimeConfig:
    """How an engine is run: execution provider, device, threads and the TensorRT provider's settings.

    ``provider``: ``"cpu"``; ``"cuda"`` (ONNX Runtime's CUDA EP: KV on the device, host inputs through pinned
    buffers); ``"tensorrt"`` (ONNX Runtime's TensorRT EP, with the CUDA EP and the CPU as fallbacks for the nodes
    TensorRT does not take; KV and host inputs as for ``"cuda"``). ``device_id`` picks the GPU of both.
    ``intra_op_threads=0`` lets ONNX Runtime choose (one per physical core), or one per CPU the process may use when
    that is fewer (``taskset``, a container's cpuset).

    The ``trt_*`` fields matter for ``provider="tensorrt"`` only. TensorRT compiles its engines when a session first
    runs (minutes for a real model) and keeps them in ``trt_cache_dir`` for the next load. ``None`` picks
    ``$TRTINFER_CACHE/ort-trt/<key>`` (default ``~/.cache/trtinfer/ort-trt/<key>``), ``<key>`` naming the engine's
    content and the onnxruntime/TensorRT versions: a rebuilt engine or a new version gets a fresh folder, never a
    stale TensorRT engine. The user's cache is chosen over the engine directory because engine directories may be
    read-only or shared between machines, and a TensorRT engine is specific to one GPU model and version.
    ``trt_timing_cache`` keeps TensorRT's kernel timings (shared by every engine: ``ort-trt/`` itself, or
    ``trt_cache_dir`` when given), which shortens later compilations. ``trt_max_workspace_size`` (bytes) caps the
    scratch memory a TensorRT layer may use; 0 leaves ONNX Runtime's default.
    """

    provider: str = "cpu"
    device_id: int = 0
    intra_op_threads: int = 0
    trt_cache_dir: str | None = None
    trt_timing_cache: bool = True
    trt_max_workspace_size: int = 0
    cuda_graphs: bool = False
    #: CPU: let MLAS keep a prepacked copy of the fp32 GEMM weights (faster at batch > 1). None: yes, unless the
    #: weights take more than half the available memory (:mod:`trtinfer.runtime.memory`); False: never (a graph
    #: run a few times, such as a build stage scored once, gains nothing from the copy)
    prepack_weights: bool | None = None
    #: CPU: run passes of several tokens (prefills, chunks, scoring) on the engine's int8 prefill graph where it has
    #: one (``trtinfer build --prefill int8``); False: every pass on the decoder graph
    prefill_graph: bool = True
    #: CPU: move the weights MLAS packs at load onto 2 MiB pages (``madvise(MADV_COLLAPSE)``, Linux 6.1+;
    #: :mod:`trtinfer.runtime.huge_pages`): decode streams them faster, the load takes ~2.6 s longer per GiB (the
    #: CLI's one-off verbs turn it off: generate and eval unless ``--huge-pages``, embed always)
    huge_pages: bool = True
    #: CPU: ONNX Runtime's worker threads spin while they wait for the next parallel section of a run (its default);
    #: False: they sleep (``session.intra_op.allow_spinning=0``) and leave the cores to other threads and processes.
    #: Serving SmolLM2 int4 on 2 cores beside its load client, not spinning gave 12% more tokens/s (fp32: within the
    #: runs' spread); with no other work on the cores it cost int4 decode ~8% (``docs/benchmarks/serving.md``)
    spinning: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.provider, str) or self.provider not in PROVIDERS:
            raise ConfigError(f"provider must be one of {PROVIDERS}, got {describe(self.provider)}", field="provider")
        _check_types(self)
        for name, note in (("device_id", ""), ("intra_op_threads", " (0: one per core)"),
                           ("trt_max_workspace_size", " bytes (0: ONNX Runtime's default)")):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0{note}, got {getattr(self, name)}", field=name)
        if self.trt_cache_dir is not None:
            folder = os.fspath(self.trt_cache_dir) if isinstance(self.trt_cache_dir, os.PathLike) else self.trt_cache_dir
            if not (isinstance(folder, str) and folder):
                raise ConfigError(f"trt_cache_dir must be a folder path or None, got {describe(self.trt_cache_dir)}",
                                  field="trt_cache_dir")
            object.__setattr__(self, "trt_cache_dir", folder)  # a Path is stored as its string (frozen: normalized here)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding settings; the same names and meanings as transformers' ``generate``.

    ``min_p`` (transformers): after top-p, drop tokens less likely than ``min_p`` times the most likely one.
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, not in transformers): each token's logit is lowered by
    ``presence_penalty * (count > 0) + frequency_penalty * count``, ``count`` being how often it was generated so far
    (the prompt does not count); negative values encourage repeats. ``no_repeat_ngram_size`` (transformers): no
    n-gram of that size occurs twice in prompt + output; 0 turns it off.
    ``logprobs=True`` (OpenAI's): each result carries, per generated token, its log-probability under the model (the
    raw distribution, before any processor) and, with ``top_logprobs=k``, the ``k`` most likely alternatives.
    ``max_time`` (transformers'): seconds after which every row ends (``finish_reason`` ``"length"``).
    Sampling at a temperature below :data:`GREEDY_BELOW` (1e-5, vLLM's) decodes greedily (dividing float32 logits
    by 1e-40 overflows).
    ``stop`` and ``eos_token_ids`` accept any list (a single string for ``stop``) and are stored as tuples.

    Beam search (transformers' names and rules): ``num_beams > 1`` keeps that many hypotheses per prompt, scored by
    summed log-probabilities divided by ``generated_length ** length_penalty``; ``early_stopping`` is ``False``
    (transformers' heuristic), ``True`` (stop once ``num_beams`` hypotheses finished) or ``"never"`` (the canonical
    search); ``num_return_sequences`` best hypotheses are returned per prompt (with sampling and one beam: that many
    independent samples per prompt). ``prompt_lookup_num_tokens=K`` drafts up to K tokens from the last
    ``max_matching_ngram_size`` tokens' earlier occurrence in the sequence and verifies them in one pass (greedy:
    the same tokens as plain greedy decoding). With ``generate(..., assistant=draft_engine)`` (assisted decoding) a
    smaller or quantized engine of the same vocabulary drafts ``num_assistant_tokens`` tokens greedily per step;
    ``num_assistant_tokens_schedule`` ``"heuristic"`` (transformers') adds 2 after a fully accepted draft and takes
    1 away otherwise, starting again from ``num_assistant_tokens`` for each prompt (transformers'
    ``"heuristic_transient"``, accepted as a synonym); ``"constant"`` keeps it.

    ``response_format`` (OpenAI's structured outputs, :mod:`trtinfer.runtime.structured`): ``{"type":
    "json_schema", "json_schema": {"schema": {...}}}``, ``{"type": "json_object"}``, ``{"type": "regex", "regex":
    ...}``, ``{"type": "choice", "choice": [...]}`` or ``{"type": "grammar", "grammar": ...}`` (Lark or GBNF): every
    token is chosen among those the grammar allows, and the sequence ends where the grammar does.

    An engine's ``generation_config.json`` (the model's) supplies the defaults of these fields where it sets them;
    anything passed to ``generate`` overrides it. With neither, the defaults are transformers' (``top_k`` 50).
    """

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    eos_token_ids: tuple[int, ...] | None = None  # None: the engine's generation config
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    max_time: float | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int = 2
    num_assistant_tokens: int = 20
    num_assistant_tokens_schedule: str = "heuristic"
    response_format: str | None = None

    def __post_init__(self) -> None:
        self._normalize_sequences()
        if self.response_format is not None:  # a dict (or its JSON) -> canonical JSON text: hashable, comparable
            from trtinfer.runtime.structured import normalize_format

            try:
                object.__setattr__(self, "response_format", normalize_format(self.response_format))
            except InputError as e:
                raise ConfigError(str(e), field="response_format") from e
        _check_types(self)
        schedule = self.num_assistant_tokens_schedule
        if schedule not in ("heuristic", "heuristic_transient", "constant"):
            raise ConfigError('num_assistant_tokens_schedule must be "heuristic", "heuristic_transient" or "constant", '
                              f"got {describe(schedule)}", field="num_assistant_tokens_schedule")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ConfigError(f"early_stopping must be True, False or \"never\", got {describe(self.early_stopping)}",
                              field="early_stopping")
        for name, valid, expected in (
                ("prompt_lookup_num_tokens", lambda v: is_int(v) and v >= 1, "a positive integer"),
                ("max_time", lambda v: is_number(v) and v > 0, "a positive number of seconds"),
                ("seed", lambda v: is_int(v) and v >= 0, "a non-negative integer")):
            value = getattr(self, name)
            if value is not None and not valid(value):
                raise ConfigError(f"{name} must be {expected} or None, got {describe(value)}", field=name)
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be within 0..max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"),
            ("temperature", self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            ("top_k", self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be within (0, 1], got {self.top_p}"),
            ("repetition_penalty", self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be within [0, 1] (0 disables it), got {self.min_p}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be within [-2, 2] (0 disables it), got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be within [-2, 2] (0 disables it), got {self.frequency_penalty}"),
            ("no_repeat_ngram_size", self.no_repeat_ngram_size >= 0,
             f"no_repeat_ngram_size must be >= 0 (0 disables it), got {self.no_repeat_ngram_size}"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20 and (self.logprobs or self.top_logprobs == 0),
             f"top_logprobs must be within 0..20 and needs logprobs=True, got {self.top_logprobs}"),
            ("num_beams", self.num_beams >= 1, f"num_beams must be >= 1, got {self.num_beams}"),
            ("num_return_sequences", 1 <= self.num_return_sequences and (
                self.num_beams == 1 or self.num_return_sequences <= self.num_beams),
             f"num_return_sequences must be within 1..num_beams ({self.num_beams}), got {self.num_return_sequences}"),
            ("num_return_sequences", self.num_return_sequences == 1 or self.num_beams > 1 or self.do_sample,
             ("num_return_sequences > 1 needs beam search (num_beams > 1) or sampling (do_sample=True): greedy "
              "decoding returns one sequence")),
            ("max_matching_ngram_size", self.max_matching_ngram_size >= 1,
             f"max_matching_ngram_size must be >= 1, got {self.max_matching_ngram_size}"),
            ("num_assistant_tokens", self.num_assistant_tokens >= 1,
             f"num_assistant_tokens must be >= 1, got {self.num_assistant_tokens}"),
        ]
        self._check_combinations()
        for name, ok, msg in checks:
            if not ok:
                raise ConfigError(msg, field=name)

    def for_sample(self, i: int) -> GenerationConfig:
        """Sample ``i``'s settings among several of one prompt (``num_return_sequences``, the server's ``n``): a given
        seed becomes ``seed + i``, so the samples differ and each is reproducible whatever it is batched with."""
        return self if self.seed is None or i == 0 else dataclasses.replace(self, seed=self.seed + i)

    def _normalize_sequences(self) -> None:
        # frozen: object.__setattr__ is the dataclass way to normalize in __post_init__
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {describe(self.stop)}", field="stop")
        object.__setattr__(self, "stop", tuple(stop))
        eos = self.eos_token_ids
        if eos is not None:
            if not isinstance(eos, (list, tuple)) or not all(is_int(t) and t >= 0 for t in eos):
                raise ConfigError(f"eos_token_ids must be a list of non-negative token ids or None, got {describe(eos)}",
                                  field="eos_token_ids")
            object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in eos))

    def _check_combinations(self) -> None:
        """What beam search and prompt lookup do not combine with, said in one line each."""
        if self.num_beams > 1:
            unsupported = [name for name, on in (
                ("do_sample", self.do_sample), ("stop", bool(self.stop)), ("logprobs", self.logprobs),
                ("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens is not None),
                ("max_time", self.max_time is not None)) if on]
            if unsupported:
                raise ConfigError(f"beam search (num_beams={self.num_beams}) does not combine with {unsupported[0]}; "
                                  "drop one of them", field=unsupported[0])
        if self.prompt_lookup_num_tokens is not None and self.num_return_sequences > 1:
            raise ConfigError("prompt_lookup_num_tokens does not combine with num_return_sequences > 1",
                              field="num_return_sequences")
