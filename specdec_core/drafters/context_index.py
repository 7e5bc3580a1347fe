"""An index over a request's `context` (a separate document, e.g. RAG passages, up to ~1M tokens), built once per
request, so that copy drafters can draw from it every step at a cost that does not grow with its size.

For each window length n a drafter asks for, the hashes of every n-token window are computed and sorted once (numpy);
a lookup is then two binary searches plus a comparison of the hits' tokens, O(log C + hits). This is the
sorted-n-gram equivalent of a suffix array for the short, fixed n that PLD (1..3) and CopySpec (γ) match on; a
drafter that needs the LONGEST match of any length (CASD) needs a real suffix array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_HASH_BASE = np.uint64(1_000_003)


def window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """[C] int64 -> [C - n + 1] uint64: a polynomial hash (mod 2^64, numpy wraps) of every n-token window."""
    count = len(tokens) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    values = tokens.astype(np.uint64) + np.uint64(1)  # so that token 0 still moves the hash
    hashes = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            hashes = hashes * _HASH_BASE + values[k : k + count]
    return hashes


class ContextIndex:
    """Occurrences of short token sequences in one fixed document, first occurrence first."""

    def __init__(self, tokens: Sequence[int] | np.ndarray):
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [C]
        # n -> (hashes of the windows that have at least one token after them, sorted [W]; their starts [W]).
        self._windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def _sorted_windows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        found = self._windows.get(n)
        if found is None:
            hashes = window_hashes(self.tokens[:-1], n)  # windows over tokens[:-1]: each has a continuation
            order = np.argsort(hashes, kind="stable")  # stable: equal hashes keep their positions ascending
            found = self._windows[n] = (hashes[order], order)
        return found

    def continuations(self, suffix: Sequence[int] | np.ndarray, num_tokens: int, count: int = 1,
                      scan: int = 32) -> list[list[int]]:
        """Up to `count` distinct runs of at most num_tokens tokens that follow occurrences of `suffix` in the
        document: the first occurrence's first, then later ones in order. At most `scan` occurrences are looked at,
        so a very common n-gram does not make a step slow."""
        suffix = np.asarray(suffix, dtype=np.int64)
        n = len(suffix)
        if n == 0 or num_tokens <= 0 or count <= 0 or len(self.tokens) <= n:
            return []
        hashes, starts = self._sorted_windows(n)
        key = window_hashes(suffix, n)[0]
        lo, hi = np.searchsorted(hashes, key, side="left"), np.searchsorted(hashes, key, side="right")
        out: list[list[int]] = []
        for start in starts[lo : min(hi, lo + scan)]:
            start = int(start)
            if not np.array_equal(self.tokens[start : start + n], suffix):
                continue  # a hash collision
            continuation = self.tokens[start + n : start + n + num_tokens].tolist()
            if continuation not in out:
                out.append(continuation)
                if len(out) == count:
                    break
        return out
