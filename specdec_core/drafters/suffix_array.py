"""A suffix array over one document (a request's context), for retrieval drafting (REST, CASD): the LONGEST suffix
of the running text that occurs in the document, and every occurrence of it, in O(m log n) per lookup.

Built once per request by prefix doubling in numpy (each round one lexsort of the (rank, rank k further) pairs; the
rounds stop when every suffix has its own rank, ~log2 of the longest repeat): about a second for 1M tokens on CPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """[n] int64 -> [n] start positions of the suffixes in lexicographic order (a shorter suffix that is a prefix
    of a longer one comes first)."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)  # [n] dense ranks of the first token
    order = np.argsort(rank, kind="stable")
    k = 1
    while k < n:
        second = np.full(n, -1, dtype=np.int64)  # rank of the suffix k further on; -1 past the end (sorts first)
        second[: n - k] = rank[k:]
        order = np.lexsort((second, rank))  # by rank, then second
        first_key, second_key = rank[order], second[order]
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = (first_key[1:] != first_key[:-1]) | (second_key[1:] != second_key[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new_group) - 1
        if rank[order[-1]] == n - 1:  # every suffix has its own rank: sorted
            break
        k *= 2
    return order.astype(np.int64)


class SuffixArray:
    def __init__(self, tokens: Sequence[int] | np.ndarray):
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [n]
        self.order = build_suffix_array(self.tokens)  # [n]

    def __len__(self) -> int:
        return len(self.tokens)

    def find(self, pattern: np.ndarray | Sequence[int]) -> tuple[int, int]:
        """[lo, hi) range of `order` whose suffixes start with `pattern` (lo == hi: none). Each probe compares the
        suffix cut to len(pattern) with the pattern as Python lists (a shorter piece that is a prefix of the pattern
        is smaller), on plain-ndarray views of memory-mapped arrays: patterns are a few tokens, where numpy's fixed
        cost per comparison and memmap's per slice dominated."""
        pattern = np.asarray(pattern).tolist()
        m = len(pattern)
        tokens, order = self.tokens.view(np.ndarray), self.order.view(np.ndarray)
        lo, hi = 0, len(order)
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            start = int(order[mid])
            if tokens[start: start + m].tolist() < pattern:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, len(order)
        while lo < hi:  # first suffix > pattern (past every one that starts with it)
            mid = (lo + hi) // 2
            start = int(order[mid])
            if tokens[start: start + m].tolist() <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def longest_suffix_match(self, text: np.ndarray, min_length: int = 1) -> tuple[int, int, int] | None:
        """The longest suffix of `text` (at least min_length tokens) that occurs in the document followed by at
        least one token -> (its length, lo, hi) of `order`, or None. Matching is monotone (if the last L tokens
        occur, so do the last L - 1), so the length is found by binary search."""
        best = None
        low, high = min_length, len(text)
        while low <= high:
            length = (low + high) // 2
            lo, hi = self.find(text[len(text) - length :])
            if hi > lo and self._has_continuation(lo, hi, length):
                best, low = (length, lo, hi), length + 1
            else:
                high = length - 1
        return best

    def _has_continuation(self, lo: int, hi: int, length: int) -> bool:
        return bool((self.order[lo:hi] + length < len(self.tokens)).any())

    def continuations(self, lo: int, hi: int, length: int, depth: int, limit: int) -> list[list[int]]:
        """The `depth` tokens after up to `limit` occurrences in [lo, hi) (evenly spread over the range when there
        are more, so token counts stay representative), in document order; occurrences at the end are skipped."""
        starts = self.order[lo:hi] + length  # where each continuation begins
        starts = starts[starts < len(self.tokens)]
        if len(starts) > limit:
            starts = starts[np.linspace(0, len(starts) - 1, limit).astype(np.int64)]
        return [self.tokens[s : s + depth].tolist() for s in np.sort(starts)]


_RECENT: "OrderedDict[tuple[int, int], SuffixArray]" = OrderedDict()
RECENT_LIMIT = 8


def shared_suffix_array(tokens: Sequence[int]) -> SuffixArray:
    """The suffix array of `tokens`, shared by requests with the same document (a RAG set asks several questions of
    one paper, and building the array for each of them was a large share of casd_strict's pass); the few most
    recent documents are kept."""
    key = (len(tokens), hash(tuple(tokens)))
    found = _RECENT.get(key)
    if found is not None and np.array_equal(found.tokens, np.asarray(tokens, dtype=np.int64)):
        _RECENT.move_to_end(key)
        return found
    built = SuffixArray(tokens)
    _RECENT[key] = built
    while len(_RECENT) > RECENT_LIMIT:
        _RECENT.popitem(last=False)
    return built
