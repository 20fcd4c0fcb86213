"""Next-token selection in numpy, in transformers' processor order.

Processors, greedy and sampling alike: repetition penalty -> presence/frequency penalties -> no-repeat n-grams ->
min_new_tokens (EOS blocked). Greedy then takes the argmax; sampling applies temperature -> top-k -> top-p -> min-p
(transformers' warpers with ``min_tokens_to_keep=1``) and draws one token per row.

Sampling sorts a candidate set, not the vocabulary: ``np.argpartition`` picks the top-k tokens (and any tied with the
k-th), or for top-p alone the top 2,048. A top-p nucleus that ends above the smallest logit of that set holds only
tokens of the set, in the order a full sort gives them: the result is the full sort's, not an approximation. A row
whose nucleus is larger (a flat distribution) sorts its logits alone and finds the boundary with block sums. The draw
is an inverse CDF at one uniform per row from that row's own generator (over the whole vocabulary in two levels,
block then token, when there is no candidate set), so a row's token depends on its own logits and generator only,
never on its batch neighbours, and a seed repeats its tokens run to run.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trtinfer.runtime.config import GREEDY_BELOW, GenerationConfig

CANDIDATES = 2048  # top-p without top-k: the candidate set a row tries before sorting its whole row
_NEAR, _NEAR_MAX_WIDTH, _NEAR_MAX_CANDIDATES = 8.0, 256, 8192  # top_ids' first look: logits within 8 of the max
_BLOCK = 256  # inverse CDF over a whole row: find the block of the vocabulary first, then the token inside it


# --- processors (in place on float logits [B, V]) ----------------------------------------------------------------
def _rows_cols(ids: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Row index and token id of every entry of the per-row id lists ``ids``, flattened."""
    arrays = [np.asarray(a, dtype=np.int64).reshape(-1) for a in ids]
    return np.repeat(np.arange(len(arrays)), [len(a) for a in arrays]), np.concatenate([np.empty(0, np.int64), *arrays])


def apply_repetition_penalty(logits: np.ndarray, seen: Sequence[np.ndarray], penalty: float) -> None:
    """In place, per row: logits of already-seen tokens are divided (if > 0) or multiplied (if < 0) by ``penalty``."""
    if penalty == 1.0:
        return
    rows, cols = _rows_cols(seen)
    vals = logits[rows, cols]  # a repeated id reads the original value each time, so writing it twice is harmless
    logits[rows, cols] = np.where(vals < 0, vals * penalty, vals / penalty)


def apply_presence_frequency_penalties(logits: np.ndarray, generated: Sequence[np.ndarray], presence: float,
                                       frequency: float) -> None:
    """In place, per row (OpenAI's rule): ``logit -= presence * (count > 0) + frequency * count``.

    ``count`` is how often the token occurs among that row's generated tokens (the prompt does not count).
    """
    if presence == 0.0 and frequency == 0.0:
        return
    rows, cols = _rows_cols(generated)
    vocab = logits.shape[-1]
    keys, counts = np.unique(rows * vocab + cols, return_counts=True)
    r, c = np.divmod(keys, vocab)
    logits[r, c] -= (presence + frequency * counts).astype(logits.dtype)


def banned_ngram_tokens(tokens: np.ndarray, n: int) -> np.ndarray:
    """Tokens that would repeat an ``n``-gram of ``tokens`` (transformers' ``NoRepeatNGramLogitsProcessor``).

    Every window of ``n`` tokens whose first ``n - 1`` equal the sequence's last ``n - 1`` bans its last token
    (``n = 1`` bans every token seen). Nothing is banned before the sequence holds ``n`` tokens.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if n <= 0 or len(tokens) < n:
        return np.empty(0, np.int64)
    windows = sliding_window_view(tokens, n)
    match = (windows[:, :-1] == tokens[len(tokens) - n + 1:]).all(axis=1)
    return windows[match, -1]  # type: ignore[no-any-return]


def apply_no_repeat_ngram(logits: np.ndarray, seen: Sequence[np.ndarray], n: int) -> None:
    """In place, per row: tokens that would repeat an ``n``-gram of the row's tokens (prompt included) get -inf."""
    if n <= 0:
        return
    rows, cols = _rows_cols([banned_ngram_tokens(s, n) for s in seen])
    logits[rows, cols] = -np.inf


# --- warpers: the tokens a row may draw from ---------------------------------------------------------------------
class _Kept(NamedTuple):
    """What top-k, top-p and min-p leave of the batch ``rows``: candidates ``ids [R, W]`` (None: the whole vocabulary
    in id order; -1 pads), ``keep [R, W]`` (None: all of them) and ``e [R, W]`` = exp(logit - row max), float32."""

    rows: np.ndarray
    ids: np.ndarray | None
    keep: np.ndarray | None
    e: np.ndarray


_LOW, _HIGH_SHIFT, _SIGN = np.uint64(0xFFFFFFFF), np.uint64(32), np.uint32(0x80000000)


def _finite(m: np.ndarray) -> np.ndarray:
    """Row maxima ``[R, 1]`` to subtract before exp; a row with no finite logit keeps its -inf (weights 0)."""
    return np.where(np.isfinite(m), m, np.float32(0))  # type: ignore[no-any-return]


def _sort_desc(ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates ``ids, vals [R, W]`` by logit, largest first; among equal logits the larger id first.

    That is a stable ascending sort read backwards, the order transformers' top-p reads its ascending sort in. (torch's
    CPU sort is not stable past ~100 entries, so which of the tokens tied at the top-p boundary transformers keeps is
    unspecified; how many it keeps is not, and that count is the same here.) One sort of unique uint64 keys, the
    logit's order-preserving bits above the id, instead of two argsorts; the sorted logits are read back from the keys.
    """
    bits = (vals + np.float32(0)).view(np.uint32)  # + 0 turns -0.0 into +0.0: equal logits, equal bits
    negative = bits >= _SIGN
    bits = np.where(negative, ~bits, bits | _SIGN)  # unsigned order = float order
    keys = np.sort((bits.astype(np.uint64) << _HIGH_SHIFT) | (ids.astype(np.uint64) & _LOW), axis=-1)[:, ::-1]
    out_ids = (keys & _LOW).astype(np.int64)
    out_ids[out_ids == 0xFFFFFFFF] = -1  # pads (id -1, logit -inf) come after every finite logit
    high = (keys >> _HIGH_SHIFT).astype(np.uint32)
    return out_ids, np.where(high >= _SIGN, high ^ _SIGN, ~high).view(np.float32)


def top_ids(x: np.ndarray, width: int) -> np.ndarray:
    """``[R, width]`` ids of each row's ``width`` largest logits, in no particular order.

    A row first looks among its logits within :data:`_NEAR` of its maximum (one comparison over the row): when at
    least ``width`` are there, they hold the ``width`` largest (every other logit is smaller than all of them), and
    the partial selection runs on those few only (language-model rows: tens to hundreds of tokens, ~2x faster at
    batch 8 for top-k 50). Other rows select over the whole row.
    """
    vocab = x.shape[-1]
    if width >= vocab:
        return np.broadcast_to(np.arange(vocab), x.shape)
    out = np.empty((len(x), width), np.int64)
    whole = np.arange(len(x))
    if width <= _NEAR_MAX_WIDTH:
        near = x >= x.max(axis=-1, keepdims=True) - np.float32(_NEAR)
        counts = near.sum(axis=-1)
        few = (width <= counts) & (counts <= _NEAR_MAX_CANDIDATES)
        for r in np.flatnonzero(few):
            cand = np.flatnonzero(near[r])
            out[r] = cand[np.argpartition(x[r, cand], cand.size - width)[cand.size - width:]]
        whole = np.flatnonzero(~few)
    if whole.size:
        out[whole] = np.argpartition(x[whole], vocab - width, axis=-1)[:, vocab - width:]
    return out


def _top_k_candidates(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids and logits of every token >= its row's k-th largest logit (transformers keeps the ties with the k-th too);
    rows with fewer than the widest row are padded with id -1, logit -inf."""
    ids = top_ids(x, k)
    vals = np.take_along_axis(x, ids, -1)
    kth = vals.min(axis=-1)
    n_ge = (x >= kth[:, None]).sum(axis=-1)
    tied = np.flatnonzero(n_ge > k)
    if tied.size == 0:
        return ids, vals
    width = int(n_ge.max())
    all_ids = np.full((len(x), width), -1, np.int64)
    all_vals = np.full((len(x), width), -np.inf, np.float32)
    all_ids[:, :k], all_vals[:, :k] = ids, vals
    for r in tied:
        row = np.flatnonzero(x[r] >= kth[r])
        all_ids[r, :row.size], all_vals[r, :row.size] = row, x[r, row]
    return all_ids, all_vals


def _nucleus(e: np.ndarray, z: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p on candidates sorted largest first (``e [R, W]``, row totals ``z [R]``): keep a token while the
    probability above it is < ``top_p``; the first token always stays.

    transformers removes a token when its ascending cumulative probability is <= 1 - top_p; for a token that sum is
    1 - (the probability of the tokens above it).
    """
    above = np.cumsum(e[:, :-1], axis=-1, dtype=np.float64)  # the probability above each token but the first
    return np.concatenate([np.ones((len(e), 1), bool), above < top_p * z[:, None]], axis=-1)


def _top_p_candidates(x: np.ndarray, top_p: float) -> list[_Kept]:
    """Top-p without top-k. Each row first tries its top :data:`CANDIDATES` tokens; a row whose nucleus reaches the
    smallest logit of that set (a token tied with it may lie outside) goes on to :func:`_top_p_whole_rows`."""
    vocab = x.shape[-1]
    ids = top_ids(x, CANDIDATES)
    ids, vals = _sort_desc(ids, np.take_along_axis(x, ids, -1))
    m = _finite(vals[:, :1])  # the row max is the first candidate
    e_all = np.subtract(x, m, dtype=np.float32)
    np.exp(e_all, out=e_all)
    z = e_all.sum(axis=-1, dtype=np.float64)  # the whole row's softmax total
    e = np.exp(vals - m)
    keep = _nucleus(e, z, top_p)
    last_kept = np.take_along_axis(vals, keep.sum(axis=-1, keepdims=True) - 1, -1)[:, 0]
    done = (last_kept > vals[:, -1]) | (CANDIDATES >= vocab)
    groups = [_Kept(np.flatnonzero(done), ids[done], keep[done], e[done])]
    if done.all():
        return groups
    if not done.any():  # every row: no copies
        return [_Kept(np.arange(len(x)), None, _top_p_whole_rows(x, m, z, top_p), e_all)]
    rest = np.flatnonzero(~done)
    return [*groups, _Kept(rest, None, _top_p_whole_rows(x[rest], m[rest], z[rest], top_p), e_all[rest])]


def _block_sums(w: np.ndarray) -> np.ndarray:
    """Running sums ``[R, blocks]`` (float64) of the weights ``w [R, V]`` by blocks of :data:`_BLOCK` tokens."""
    return np.cumsum(np.add.reduceat(w, np.arange(0, w.shape[-1], _BLOCK), axis=-1, dtype=np.float64), axis=-1)


def _block(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The weights ``[R, _BLOCK]`` of block ``b[r]`` of each row of ``w [R, V]`` (0 past the vocabulary)."""
    vocab = w.shape[-1]
    cols = b[:, None] * _BLOCK + np.arange(_BLOCK)
    return np.where(cols < vocab, w[np.arange(len(w))[:, None], np.minimum(cols, vocab - 1)], 0)


def _top_p_whole_rows(x: np.ndarray, m: np.ndarray, z: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p mask ``[R, V]`` for rows whose nucleus is large: sort the logits alone (no ids), find the boundary
    with block sums of their probabilities, then keep every logit above the boundary logit and, of the logits equal
    to it, as many as the nucleus still holds, the larger ids first (the order of :func:`_sort_desc`)."""
    rows, vocab = np.arange(len(x)), x.shape[-1]
    xs = np.sort(x, axis=-1)
    es = np.exp(xs - m)[:, ::-1]  # exp before reversing: numpy's exp is fastest on contiguous rows
    xs = xs[:, ::-1]
    blocks = _block_sums(es)
    limit = top_p * z
    b = np.minimum((blocks < limit[:, None]).sum(axis=-1), blocks.shape[-1] - 1)  # the block the nucleus ends in
    above = np.cumsum(_block(es, b), axis=-1)
    above = np.where(b > 0, blocks[rows, b - 1], 0.0)[:, None] + np.concatenate(
        [np.zeros((len(x), 1)), above[:, :-1]], axis=-1)
    n_keep = np.clip(b * _BLOCK + (above < limit[:, None]).sum(axis=-1), 1, vocab)  # a token stays while above < limit
    boundary = xs[rows, n_keep - 1]
    keep = x >= boundary[:, None]
    extra = keep.sum(axis=-1) - n_keep  # tokens equal to the boundary logit past the nucleus: the smaller ids go
    for r in np.flatnonzero(extra > 0):
        keep[r, np.flatnonzero(x[r] == boundary[r])[:extra[r]]] = False
    return keep


def _kept(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> list[_Kept]:
    """Top-k -> top-p -> min-p on ``x [B, V]`` (already divided by the temperature), as groups of rows."""
    rows = np.arange(len(x))
    top_k = top_k if 0 < top_k < x.shape[-1] else 0
    if not top_k and top_p >= 1.0:
        e = np.subtract(x, _finite(x.max(axis=-1, keepdims=True)), dtype=np.float32)
        np.exp(e, out=e)
        return [_Kept(rows, None, e >= min_p if min_p > 0 else None, e)]
    if top_k:
        ids, vals = _sort_desc(*_top_k_candidates(x, top_k))
        e = np.exp(vals - _finite(vals[:, :1]))  # the row max is the first candidate
        keep = ids >= 0
        if top_p < 1.0:  # top-p renormalizes over what top-k left
            keep &= _nucleus(e, e.sum(axis=-1, dtype=np.float64), top_p)
        groups = [_Kept(rows, ids, keep, e)]
    else:
        groups = _top_p_candidates(x, top_p)
    if min_p > 0:  # p >= min_p * p_max; the row max has e = 1 and survives top-k and top-p
        groups = [g._replace(keep=g.e >= min_p if g.keep is None else g.keep & (g.e >= min_p)) for g in groups]
    return groups


def filter_logits(logits: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """``logits [B, V]`` with every token top-k, then top-p, then min-p remove set to -inf (transformers' warpers
    with ``min_tokens_to_keep=1``; 0, 1.0 and 0.0 turn one off): the tokens :func:`sample` draws from."""
    x = np.asarray(logits, dtype=np.float32)
    out = np.full(x.shape, -np.inf, np.float32)
    for g in _kept(x, top_k, top_p, min_p):
        if g.ids is None:
            out[g.rows] = x[g.rows] if g.keep is None else np.where(g.keep, x[g.rows], -np.inf)
            continue
        keep = g.keep if g.keep is not None else g.ids >= 0
        rows = np.broadcast_to(g.rows[:, None], g.ids.shape)[keep]
        out[rows, g.ids[keep]] = x[rows, g.ids[keep]]
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for -inf entries."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


# --- the draw ----------------------------------------------------------------------------------------------------
def _search(cum: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row of a running sum ``cum [R, W]``: the first index whose sum exceeds ``target [R]``. A target that
    rounding leaves at or past the total picks the last entry with weight (the first, in a row with none)."""
    pos = (cum <= target[:, None]).sum(axis=-1)
    over = pos >= cum.shape[-1]
    if over.any():
        pos[over] = np.argmax(cum[over] >= cum[over, -1:], axis=-1)
    return pos  # type: ignore[no-any-return]


def _draw_blocked(w: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse CDF over whole rows of weights ``w [R, V]``: the block of the vocabulary first, then the token in it
    (a running sum over all V in float64 costs more than the rest of a sampling step)."""
    blocks = _block_sums(w)
    target = u * blocks[:, -1]
    b = _search(blocks, target)
    target -= np.where(b > 0, blocks[np.arange(len(w)), b - 1], 0.0)
    inner = np.cumsum(_block(w, b), axis=-1, dtype=np.float64)
    return b * _BLOCK + _search(inner, target)  # type: ignore[no-any-return]


def sample(logits: np.ndarray, u: np.ndarray, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """One token per row of ``logits [B, V]`` (already divided by the temperature) from what :func:`filter_logits`
    keeps, by inverse CDF at the uniforms ``u [B]`` in [0, 1). Candidates are read largest first, the whole
    vocabulary in id order."""
    x = np.asarray(logits, dtype=np.float32)
    u = np.asarray(u, dtype=np.float64)
    out = np.empty(len(x), np.int64)
    for g in _kept(x, top_k, top_p, min_p):
        w = g.e if g.keep is None else np.where(g.keep, g.e, np.float32(0))
        if g.ids is None:
            out[g.rows] = _draw_blocked(w, u[g.rows])
            continue
        cum = np.cumsum(w, axis=-1, dtype=np.float64)
        pos = _search(cum, u[g.rows] * cum[:, -1])
        out[g.rows] = np.take_along_axis(g.ids, pos[:, None], -1)[:, 0]
    return out


def apply_processors(logits: np.ndarray, cfg: GenerationConfig, seen: Sequence[np.ndarray], n_generated: int,
                     eos_ids: Sequence[int]) -> np.ndarray:
    """transformers' logits processors of ``cfg`` over ``logits [B, V]`` (a float32 copy when any applies).

    Repetition penalty, presence/frequency penalties, no-repeat n-grams, then ``min_new_tokens`` (EOS gets -inf while
    fewer tokens were generated). ``seen[r]`` holds row r's prompt and generated tokens (the last ``n_generated``).
    Beam search runs them on log-probabilities, as transformers does.
    """
    rewrite = (cfg.repetition_penalty != 1.0 or cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0
               or cfg.no_repeat_ngram_size > 0 or (n_generated < cfg.min_new_tokens and bool(eos_ids)))
    x = np.array(logits, dtype=np.float32) if rewrite else np.asarray(logits, dtype=np.float32)
    apply_repetition_penalty(x, seen, cfg.repetition_penalty)
    if cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0:  # the generated tokens: sliced only if needed
        apply_presence_frequency_penalties(x, [np.asarray(s)[len(s) - n_generated:] for s in seen],
                                           cfg.presence_penalty, cfg.frequency_penalty)
    apply_no_repeat_ngram(x, seen, cfg.no_repeat_ngram_size)
    if n_generated < cfg.min_new_tokens and eos_ids:
        x[:, list(eos_ids)] = -np.inf
    return x


def select_next(logits: np.ndarray, cfg: GenerationConfig, seen: Sequence[np.ndarray], n_generated: int,
                eos_ids: Sequence[int], rngs: Sequence[np.random.Generator], *,
                hook: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Pick one token per row of ``logits [B, V]``; ``rngs`` holds one generator per row (sampling only).

    ``seen``, ``n_generated`` and ``eos_ids`` as in :func:`apply_processors`. ``hook`` (the user's logits processor)
    runs after the built-in processors and before temperature, top-k, top-p and min-p: transformers' order. Sampling
    takes exactly one uniform from each row's generator per call.
    """
    x = apply_processors(logits, cfg, seen, n_generated, eos_ids)
    if hook is not None:
        x = np.asarray(hook(x), dtype=np.float32)
    if not cfg.do_sample or cfg.temperature < GREEDY_BELOW:
        return x.argmax(axis=-1).astype(np.int64)  # type: ignore[no-any-return]
    if cfg.temperature != 1.0:
        x = x / np.float32(cfg.temperature)
    u = np.array([rng.random() for rng in rngs], dtype=np.float64)
    return sample(x, u, cfg.top_k, cfg.top_p, cfg.min_p)
