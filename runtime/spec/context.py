"""`ContextNgrams`: where each n-gram of one request's own tokens (prompt and output) was last
followed, kept up to date as tokens are appended (each new position costs one entry per window
size). Keyed by the n-grams' hashes, as `hicache/ngram.py` is: no objects for the garbage
collector to track."""
from __future__ import annotations

from hicache.ngram import NONE, Proposal


class ContextNgrams:
    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self._last: dict[int, int] = {}  # n-gram hash -> the position of the token after its latest occurrence
        self._indexed = 0  # the n-grams ending before positions [0, _indexed) are recorded

    def propose(self, tokens: list[int], n: int) -> Proposal:
        """Up to `n` tokens that followed the latest earlier occurrence of the longest matching
        tail of `tokens` (the request's tokens so far: those seen before plus any appended)."""
        self._index(tokens)
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            p = self._last.get(hash(tuple(tokens[-w:])))
            if p is not None:
                return Proposal(tokens[p:p + n], w)
        return NONE

    def _index(self, tokens: list[int]) -> None:
        """Records the n-grams before positions [_indexed, len(tokens)): a later position wins."""
        hi = len(tokens)
        for w in range(self.min_window, self.max_window + 1):
            first = max(self._indexed, w)
            if first < hi:
                cols = [tokens[first - w + i:hi - w + i] for i in range(w)]
                self._last.update(zip(map(hash, zip(*cols)), range(first, hi)))
        self._indexed = hi
