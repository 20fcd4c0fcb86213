"""The n-gram draft proposer of prompt-lookup decoding (transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram``
speculative method): drafts copied from the sequence itself. Used by :mod:`trtinfer.runtime.speculative` and the
server's scheduler alike."""
from __future__ import annotations

from collections.abc import Sequence


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
        if k <= 0:
            return []
        for n in range(min(self.max_n, size - 1), 0, -1):
            at = self._first.get(tuple(seq[size - n:]))
            if at is not None and at < size - n:  # an occurrence before the suffix itself: it has a continuation
                return seq[at + n:at + n + k]
        return []
