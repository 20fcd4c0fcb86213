"""Scoring: ``log p(token t | tokens before t)`` for every token of a sequence, perplexity, sliding windows.

Runs on any :class:`~trtinfer.runtime.session.DecoderSession` whose graph returns logits at chosen positions
(engines built with the ``logits_positions`` input, or graphs exported with ``logits="all"``): one sequence at a
time (batch 1), in chunks that continue the KV cache, so at most ``chunk x vocab`` logits are held at once.
:func:`open_stage_session` opens such a session on a stage directory's graph (no engine directory needed), e.g.
to score the fp32 optimize stage a quantized engine is compared with.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.errors import InputError
from trtinfer.runtime.config import RuntimeConfig, is_int, token_ids
from trtinfer.runtime.probes import log_normalizer
from trtinfer.runtime.session import DecoderSession
from trtinfer.runtime.slots import SlotCache

MAX_CHUNK = 256  # tokens per forward pass when scoring
CHUNK_LOGITS = 2**25  # at most this many logits per chunk (128 MiB of float32): Gemma-3's 262k vocab gets 128 tokens


@dataclass(frozen=True, eq=False)
class ScoreResult:
    """One sequence scored: for each token ``t = 1..n-1``, its log-probability given the tokens before it.

    ``logprobs[i]`` and ``argmax[i]`` are about ``token_ids[i + 1]``: the first token has no context and is not
    scored. ``argmax`` is the model's top-1 prediction at that position (for top-1 agreement between engines);
    ``perplexity = exp(-mean(logprobs))``.
    """

    token_ids: list[int]
    logprobs: np.ndarray  # float32 [n-1]
    argmax: np.ndarray  # int64 [n-1]
    perplexity: float


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of one long sequence scored in sliding windows (:func:`windowed_perplexity`).

    ``tokens`` is the sequence's length; ``scored`` how many of its tokens were predicted (``tokens - 1``: all but
    the first, less each window's first token when ``stride == window``); ``nll`` their summed negative
    log-likelihood, so ``perplexity = exp(nll / scored)``.
    """

    perplexity: float
    tokens: int
    scored: int
    nll: float
    window: int
    stride: int

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return asdict(self)


def check_ids(ids: Sequence[int], vocab_size: int, max_len: int, what: str = "the sequence") -> list[int]:
    """``ids`` as ints, or InputError when there is nothing to score, it is too long, or an id is outside the vocab."""
    row = token_ids(ids, what, vocab_size)
    if len(row) < 2:
        raise InputError(f"{what} has {len(row)} token(s); scoring needs at least 2 (the first has no context)")
    if len(row) > max_len:
        raise InputError(f"{what} has {len(row)} tokens; the engine's max sequence length is {max_len}: shorten it, "
                         "score it in windows (Engine.perplexity, `trtinfer eval`), or rebuild with a larger "
                         "--max-seq-len")
    return row


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per forward pass: :data:`MAX_CHUNK`, fewer for large vocabularies (logits memory stays bounded)."""
    return max(16, min(MAX_CHUNK, CHUNK_LOGITS // max(1, vocab_size)))


def log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``log_softmax(logits)[i, targets[i]]`` (float64's value, returned as float32) and each row's argmax, without
    the ``[n, V]`` float64 log-softmax: only the targets' entries are formed (4x faster at Gemma-3's 262k vocabulary)."""
    x = np.asarray(logits, np.float32)
    m, log_sum = log_normalizer(x, np.float64)
    picked = x[np.arange(len(targets)), targets].astype(np.float64) - m[:, 0] - log_sum[:, 0]
    return picked.astype(np.float32), x.argmax(axis=-1).astype(np.int64)


def sequence_logprobs(session: DecoderSession, ids: Sequence[int], first: int = 1,
                      chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities and top-1 predictions of ``ids[first:]``, each given every token before it.

    ``ids`` must already be checked (:func:`check_ids`). Tokens before ``first`` are context only: their logits
    are not computed except where a chunk would otherwise have none.
    """
    session.check_can_score()
    n = len(ids)
    chunk = chunk or chunk_tokens(int(session.manifest.geometry["vocab_size"]))
    logprobs, argmax = np.empty(n - first, np.float32), np.empty(n - first, np.int64)
    fed = n - 1  # the last token's logits would predict nothing
    cache = SlotCache(session, 1, fed, reserve=False)
    try:
        for c0 in range(0, fed, chunk):
            c1 = min(c0 + chunk, fed)
            wanted = range(max(c0, first - 1), c1)  # logits at position p predict token p + 1
            positions = [p - c0 for p in wanted] or [c1 - c0 - 1]  # a context-only chunk still returns one row
            logits = cache.feed(0, ids[c0:c1], positions)
            if not wanted:
                continue
            targets = np.asarray(ids[wanted.start + 1:wanted.stop + 1], dtype=np.int64)
            at = slice(wanted.start + 1 - first, wanted.stop + 1 - first)  # the predicted tokens' places
            logprobs[at], argmax[at] = log_softmax_at(logits, targets)
    finally:
        cache.close()
    return logprobs, argmax


def score_ids(session: DecoderSession, ids: Sequence[int], *, chunk: int | None = None,
              what: str = "the sequence") -> ScoreResult:
    """Score one sequence of token ids on ``session``: log p(token t | tokens before t) for t = 1..n-1.

    The sequence must fit the session's max sequence length (no silent cut: longer ones are an InputError; use
    :func:`windowed_perplexity` for long texts).
    """
    row = check_ids(ids, int(session.manifest.geometry["vocab_size"]), session.manifest.max_seq_len, what)
    logprobs, argmax = sequence_logprobs(session, row, 1, chunk)
    ppl = math.exp(-float(logprobs.astype(np.float64).mean()))
    return ScoreResult(row, logprobs, argmax, ppl)


def windowed_perplexity(session: DecoderSession, ids: Sequence[int], window: int | None = None,
                        stride: int | None = None, *, chunk: int | None = None) -> PerplexityResult:
    """Perplexity of a sequence of any length, scored in windows of ``window`` tokens moved by ``stride``.

    The sliding-window method of HF's "Perplexity of fixed-length models": windows start every ``stride`` tokens;
    each scores only the tokens no earlier window scored, with the up to ``window - stride`` tokens before them as
    context. ``window`` defaults to the engine's max sequence length (and may not exceed it), ``stride`` to
    ``window // 2``. A sequence no longer than ``window`` is one window: the same result as :func:`score_ids`.
    With ``stride == window`` the windows do not overlap and each window's first token goes unscored.
    """
    max_len = session.manifest.max_seq_len
    for name, v in (("window", window), ("stride", stride)):
        if v is not None and not is_int(v):
            raise InputError(f"{name} must be a whole number of tokens, got {v!r}")
    window = max_len if window is None else int(window)
    if not 2 <= window <= max_len:
        raise InputError(f"window must be between 2 and the engine's max sequence length {max_len}, got {window}")
    stride = max(1, window // 2) if stride is None else int(stride)
    if not 1 <= stride <= window:
        raise InputError(f"stride must be between 1 and the window ({window}), got {stride}")
    row = check_ids(ids, int(session.manifest.geometry["vocab_size"]), max_len=2**63)  # any length: windows
    n, nll, scored, done = len(row), 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        first = max(done - begin, 1)  # tokens before ``done`` were scored by an earlier window
        if first < end - begin:
            lp, _ = sequence_logprobs(session, row[begin:end], first, chunk)
            nll -= float(lp.astype(np.float64).sum())
            scored += len(lp)
        done = end
        if end == n:
            break
    return PerplexityResult(math.exp(nll / scored), n, scored, nll, window, stride)


def open_stage_session(stage: Any, config: RuntimeConfig | None = None) -> DecoderSession:
    """An ONNX Runtime session on a stage directory's graph (a path or a ``StageDir``), for :func:`score_ids`.

    The graph must return logits at chosen positions: an optimize stage (``trtinfer optimize``), or an export made
    with ``--logits all``. The session runs one sequence at a time (it has no row-selection graph for batches).
    """
    from trtinfer.artifact import ONNX_NAME, Manifest, StageDir, read_stage
    from trtinfer.runtime.ort_session import OrtDecoderSession
    from trtinfer.stages import default_max_seq_len

    st = stage if isinstance(stage, StageDir) else read_stage(Path(stage), verify=False)
    opt = st.history.get("optimize", {}).get("config", {})
    max_seq = int(opt.get("max_seq_len") or default_max_seq_len(st.geometry))
    if st.info.get("checkpoint_weights"):
        raise InputError(f"{st.path}'s graph reads {st.info['checkpoint_weights']} weights from the checkpoint it was "
                         "exported from; ONNX Runtime needs them in files: score the engine built from it, or a whole "
                         "copy (with trtinfer.stage_weights.materialized(stage) as whole: ...)")
    session = OrtDecoderSession(st.path, Manifest.of_stage(st, ONNX_NAME, max_seq), config or RuntimeConfig())
    try:
        session.check_can_score()
    except InputError:
        session.close()
        raise
    return session
