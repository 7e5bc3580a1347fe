"""Prompt lookup decoding (PLD): match the last n tokens (n = max_ngram .. min_ngram) in the history, copy what followed.

Unlike CopySpec's index this rescans the history every step (O(history)); it is the peer every copy method is
measured against (HF `prompt_lookup_num_tokens`, vLLM's n-gram speculation).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..draft_tree import build_trie
from .base import Draft, Drafter, empty_draft
from .draft_length import DraftLength


def find_prompt_lookup_draft(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """Tokens following the first earlier occurrence of the longest suffix n-gram (n from max_ngram down).

    tokens: [T] int64. Returns [] when no suffix n-gram reappears or num_tokens <= 0.
    """
    found = find_prompt_lookup_candidates(tokens, max_ngram, min_ngram, num_tokens, count=1)
    return found[0] if found else []


def find_prompt_lookup_candidates(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int,
                                  count: int) -> list[list[int]]:
    """Up to `count` distinct continuations of the longest suffix n-gram that reappears: the first occurrence's
    first (what find_prompt_lookup_draft drafts), then later occurrences' in order."""
    length = len(tokens)
    if num_tokens <= 0:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]  # [n]
        # Windows over tokens[:-1], so every match has at least one token after it and the suffix never matches itself.
        windows = sliding_window_view(tokens[:-1], n)  # [T - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        out: list[list[int]] = []
        for hit in hits:
            start = int(hit) + n
            continuation = tokens[start : start + num_tokens].tolist()
            if continuation not in out:
                out.append(continuation)
            if len(out) == count:
                break
        if out:
            return out
    return []


class PromptLookupDrafter(Drafter):
    """candidates > 1: the continuations of several occurrences of the matched n-gram, drafted as one tree."""

    proposes_trees = True

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1, adaptive: bool = False,
                 candidates: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.length = DraftLength(num_tokens, adaptive=adaptive)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.candidates = candidates
        self._buffer = np.zeros(0, dtype=np.int64)
        self._size = 0

    def _as_array(self, tokens: Sequence[int]) -> np.ndarray:
        # Keep a growing numpy copy so each step converts only the new tokens.
        if len(tokens) > len(self._buffer):
            grown = np.zeros(max(2 * len(self._buffer), len(tokens), 1024), dtype=np.int64)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        self._buffer[self._size : len(tokens)] = tokens[self._size :]
        self._size = len(tokens)
        return self._buffer[: self._size]

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        if self.candidates > 1:
            branches = find_prompt_lookup_candidates(
                self._as_array(tokens), self.max_ngram, self.min_ngram, min(self.length.current, max_tokens),
                self.candidates)
            if not branches:
                return empty_draft()
            draft_tokens, parents = build_trie(branches)
            return Draft(tokens=draft_tokens, source="lookup", from_context=True, parents=parents).truncated(max_tokens)
        found = find_prompt_lookup_draft(
            self._as_array(tokens), self.max_ngram, self.min_ngram, min(self.length.current, max_tokens)
        )
        if not found:
            return empty_draft()
        return Draft(tokens=found, source="lookup", from_context=True)

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        if draft.source == "lookup":
            self.length.update(draft.max_depth, num_accepted)
