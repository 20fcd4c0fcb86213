"""Automatic prefix caching over a slot KV cache: a new request reuses the KV of the longest prefix some row holds.

::

    row 0  [system prompt ........ | user A | answer A]      running or finished (finished rows keep their KV)
    row 1  [system prompt ........ | user B]                 prefilling
    new    [system prompt ........ | user C]  -> longest common prefix with row 0 or 1: the system prompt
           free row holding it: taken in place (its length cut to the prefix)   busy row: prefix copied to a free row

Every row remembers the tokens whose KV it holds (prompt and fed-back generated tokens), so a match is exact and
any length, not rounded to blocks. Only the part a prompt's own prefill would have computed is reused: the leading
tokens whose KV came from prompt passes of two or more tokens. A decode step's one-token pass (an answer's tokens), or
a draft's verification on the decoder graph, may round differently from a prompt chunk (SmolLM2-135M int4: 0.3 on the
logits; 7 of 8 second turns of a conversation answered differently from the same prompt alone when the first turn's
answer was reused), so a conversation's next turn would prefill the last answer again; beam search's continuations, which
decode anyway, reuse everything. A scheduler with nothing to run recomputes finished rows' decoded tokens as a
prompt's chunk computes them (:meth:`~trtinfer.runtime.slots.SlotCache.refill`), so a next turn that comes after
a pause reuses the answer too. vLLM hashes blocks because its KV is thousands of pages shared by reference; here
the KV budget is a handful of rows, and comparing a prompt with each row's tokens (one vectorised comparison a row)
costs less than hashing it. Rows of finished requests stay matchable until a new request needs their room:
least recently used first (eviction under the KV budget). A request always prefills at least its last prompt
token (its logits choose the first new token), so the reuse is at most ``len(prompt) - 1``.
"""
from __future__ import annotations

#: the shortest prefix worth reusing (vLLM's default block size): a shorter match (a BOS token, a chat template's
#: first tokens) would evict a row holding more for a few tokens' prefill
MIN_REUSE = 16

import itertools
from collections.abc import Sequence

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (one vectorised comparison)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class PrefixIndex:
    """What each of ``rows`` rows holds (token ids whose KV is in it) and when it was last used."""

    def __init__(self, rows: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.prefilled = [0] * rows  # each row's leading tokens whose KV a prompt's prefill computed (see above)
        self._used = [0] * rows  # a tick of the last use (0: never): the LRU order
        self._clock = itertools.count(1)

    def extend(self, row: int, tokens: Sequence[int], prompt: bool = False) -> None:
        """Row ``row`` now also holds ``tokens`` after what it held; ``prompt``: computed as a prompt's chunk is."""
        if prompt and len(tokens) > 1 and self.prefilled[row] == len(self.tokens[row]):
            self.prefilled[row] += len(tokens)
        self.tokens[row].extend(int(t) for t in tokens)
        self._used[row] = next(self._clock)

    def cut(self, row: int, n: int) -> None:
        """Row ``row`` keeps its first ``n`` tokens (the rest will be overwritten)."""
        del self.tokens[row][n:]
        self.prefilled[row] = min(self.prefilled[row], n)
        self._used[row] = next(self._clock)

    def longest(self, prompt: Sequence[int], rows: Sequence[int], decoded: bool = False) -> tuple[int | None, int]:
        """``(row, n)``: the row among ``rows`` sharing the longest prefix with ``prompt`` and its length (``(None,
        0)`` when none shares a token), within each row's prefilled part (all it holds with ``decoded``). Ties go to
        the most recently used row."""
        best: tuple[int | None, int] = (None, 0)
        for row in sorted(rows, key=lambda r: -self._used[r]):
            held = self.tokens[row] if decoded else self.tokens[row][:self.prefilled[row]]
            # compared only when it could share more than the best so far
            if min(len(held), len(prompt)) > best[1] and (common := common_prefix(held, prompt)) > best[1]:
                best = (row, common)
        return best

    def most_recent_unprefilled(self, rows: Sequence[int]) -> int | None:
        """The most recently used of ``rows`` holding tokens past its prefilled part (decoded ones), or None."""
        stale = [r for r in rows if self.prefilled[r] < len(self.tokens[r]) and len(self.tokens[r]) > 1]
        return max(stale, key=lambda r: self._used[r]) if stale else None

    def least_recent(self, rows: Sequence[int]) -> int:
        """The least recently used of ``rows`` (an empty row first): the one to evict."""
        return min(rows, key=lambda r: (self._used[r], r))
