"""CopySpec's γ-token index (Dumitru et al., §3.1 and App. B): a rolling hash of every γ-token window of the history.

Appending a token costs O(γ): the window hash is rolled in O(1) and a hit is confirmed by comparing γ tokens, so
the cost per step does not grow with the history (unlike prompt lookup, which rescans it). Only the FIRST occurrence
of each distinct window is kept: the paper copies from the first match that does not overlap the current suffix,
and if the first occurrence overlaps, every later one does too.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

MERSENNE_61 = (1 << 61) - 1


class CopyIndex:
    """Index of an append-only token sequence; positions are 0-based window starts."""

    def __init__(self, gamma: int = 3, base: int = 1_000_003, modulus: int = MERSENNE_61, keep_all: bool = False):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.gamma = gamma
        self.base = base
        self.modulus = modulus
        self.tokens = array("q")  # the indexed sequence
        self._first: dict[int, int] = {}  # window hash -> start of the first window with that hash
        self._collisions: dict[int, list[int]] = {}  # hash -> first starts of OTHER distinct windows with it
        # Multi-candidate copying also needs the later occurrences: hash -> every window start with it, in order.
        self._all: dict[int, list[int]] | None = {} if keep_all else None
        self._hash = 0  # hash of the last (up to γ) tokens
        self._drop_factor = pow(base, gamma - 1, modulus)  # weight of the token leaving the window

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Iterable[int]) -> None:
        for token in new_tokens:
            self.append(token)

    def append(self, token: int) -> None:
        tokens, gamma, mod = self.tokens, self.gamma, self.modulus
        value = token + 1  # so that token 0 still moves the hash
        if len(tokens) >= gamma:
            self._hash = (self._hash - (tokens[-gamma] + 1) * self._drop_factor) % mod
        self._hash = (self._hash * self.base + value) % mod
        tokens.append(token)
        if len(tokens) >= gamma:
            self._insert(self._hash, len(tokens) - gamma)

    def _same_window(self, a: int, b: int) -> bool:
        gamma = self.gamma
        return self.tokens[a : a + gamma] == self.tokens[b : b + gamma]

    def _insert(self, window_hash: int, start: int) -> None:
        if self._all is not None:
            self._all.setdefault(window_hash, []).append(start)
        first = self._first.get(window_hash)
        if first is None:
            self._first[window_hash] = start
            return
        if self._same_window(first, start):
            return  # seen before: the first occurrence stays
        others = self._collisions.setdefault(window_hash, [])
        if not any(self._same_window(other, start) for other in others):
            others.append(start)  # a true hash collision: a different window with the same hash

    def first_occurrence(self) -> int | None:
        """Start of the first occurrence of the last γ tokens (confirmed by comparison), or None."""
        gamma = self.gamma
        if len(self.tokens) < gamma:
            return None
        suffix_start = len(self.tokens) - gamma
        first = self._first.get(self._hash)
        if first is None:
            return None
        if self._same_window(first, suffix_start):
            return first
        for other in self._collisions.get(self._hash, ()):
            if self._same_window(other, suffix_start):
                return other
        return None

    def find_copy_source(self) -> int | None:
        """Position right after the first earlier occurrence of the suffix that does not overlap it, or None.

        Paper (1-based): first p with p + γ - 1 < t - γ + 1; here 0-based: p + γ - 1 < t - γ.
        """
        start = self.first_occurrence()
        if start is None:
            return None
        if start + self.gamma - 1 < len(self.tokens) - self.gamma:
            return start + self.gamma
        return None

    def copy_candidate(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the suffix's first earlier occurrence ([] when none)."""
        source = self.find_copy_source()
        if source is None or max_tokens <= 0:
            return []
        return self.tokens[source : source + max_tokens].tolist()

    def copy_candidates(self, max_tokens: int, count: int, scan: int = 32) -> list[list[int]]:
        """Up to `count` distinct continuations of the suffix: the first occurrence's (the paper's candidate) first,
        then the most recent other occurrences' (recent text is the likelier repeat). At most `scan` occurrences
        are looked at, so a very common window does not make a step slow. Needs keep_all=True."""
        first = self.copy_candidate(max_tokens)
        out = [first] if first else []
        if self._all is None or max_tokens <= 0 or len(self.tokens) < self.gamma:
            return out
        gamma = self.gamma
        suffix_start = len(self.tokens) - gamma
        starts = self._all.get(self._hash, ())
        for start in reversed(starts[-scan:]):
            if len(out) >= count:
                break
            if start + gamma - 1 >= suffix_start or not self._same_window(start, suffix_start):
                continue  # overlaps the suffix, or a hash collision
            continuation = self.tokens[start + gamma : start + gamma + max_tokens].tolist()
            if continuation and continuation not in out:
                out.append(continuation)
        return out

    def snapshot(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        """The index's content, for tests comparing incremental updates with a rebuild."""
        return dict(self._first), {k: list(v) for k, v in self._collisions.items()}
