"""Prompt lookup decoding (PLD): match the last n tokens (n = max_ngram .. min_ngram) in the history, copy what followed.

Unlike CopySpec's index this rescans the history every step (O(history)); it is the peer every copy method is
compared with (HF `prompt_lookup_num_tokens`, vLLM's n-gram speculation). The scan is a numba loop where numba
compiles (numpy's sliding windows were a large share of a batched GPU step).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..kernels.numba_kernels import LazyKernel
from ..method_options import DEFAULTS
from .base import CONTEXT_SOURCE, Draft, Drafter, RequestContext, copy_draft, empty_draft
from .context_index import ContextIndex
from .draft_length import DraftLength

LOOKUP_SOURCE = "lookup"


def find_prompt_lookup_draft(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """Tokens following the first earlier occurrence of the longest suffix n-gram (n from max_ngram down).

    tokens: [T] int64. Returns [] when no suffix n-gram reappears or num_tokens <= 0.
    """
    if num_tokens <= 0:
        return []
    kernel = match_kernel()
    if kernel is not None:  # every n in one compiled call: a batch's rows each pay its dispatch once a step
        start = kernel(np.ascontiguousarray(tokens, dtype=np.int64), max_ngram, min_ngram)
        return tokens[start: start + num_tokens].tolist() if start >= 0 else []
    found = find_prompt_lookup_candidates(tokens, max_ngram, min_ngram, num_tokens, count=1)
    return found[0] if found else []


def find_prompt_lookup_candidates(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_tokens: int,
                                  count: int) -> list[list[int]]:
    """Up to `count` distinct continuations of the longest suffix n-gram that reappears: the first occurrence's
    first (what find_prompt_lookup_draft drafts), then later occurrences' in order."""
    if num_tokens <= 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        found = history_continuations(tokens, n, num_tokens, count)
        if found:
            return found
    return []


def _compile():
    from numba import njit

    @njit(cache=True)
    def suffix_hits(tokens, n, out):  # pragma: no cover - compiled
        """Writes to out, in order, every i where tokens[i:i + n] equals the last n tokens and i + n < len(tokens)
        (a window of tokens[:-1]) -> how many."""
        length = tokens.shape[0]
        count = 0
        for i in range(length - n):
            j = 0
            while j < n and tokens[i + j] == tokens[length - n + j]:
                j += 1
            if j == n:
                out[count] = i
                count += 1
        return count

    return suffix_hits


hit_kernel = LazyKernel(_compile, "compiled prompt lookup", "; using numpy's sliding windows")


def _compile_match():
    from numba import njit

    @njit(cache=True)
    def first_match(tokens, max_n, min_n):  # pragma: no cover - compiled
        """Where the continuation of the first earlier occurrence of the longest suffix n-gram starts (n from max_n
        down to min_n; occurrences as suffix_hits finds them) -> its index, or -1."""
        length = tokens.shape[0]
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            for i in range(length - n):
                j = 0
                while j < n and tokens[i + j] == tokens[length - n + j]:
                    j += 1
                if j == n:
                    return i + n
        return -1

    return first_match


match_kernel = LazyKernel(_compile_match, "compiled prompt lookup match", "; scanning each n-gram length apart")


def suffix_hits(tokens: np.ndarray, n: int) -> np.ndarray:
    """tokens [T] -> [hits] the starts of the earlier occurrences of the last n tokens, in order. Windows over
    tokens[:-1], so every match has at least one token after it and the suffix never matches itself."""
    kernel = hit_kernel()
    if kernel is not None:
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        out = np.empty(max(0, len(tokens) - n), dtype=np.int64)
        return out[: kernel(tokens, n, out)]
    windows = sliding_window_view(tokens[:-1], n)  # [T - n, n]
    return np.flatnonzero((windows == tokens[len(tokens) - n :]).all(axis=1))


def history_continuations(tokens: np.ndarray, n: int, num_tokens: int, count: int) -> list[list[int]]:
    """Up to `count` distinct continuations of the last n tokens' earlier occurrences, first occurrence first."""
    hits = suffix_hits(tokens, n)
    out: list[list[int]] = []
    for hit in hits:
        start = int(hit) + n
        continuation = tokens[start : start + num_tokens].tolist()
        if continuation not in out:
            out.append(continuation)
        if len(out) == count:
            break
    return out


class PromptLookupDrafter(Drafter):
    """candidates > 1: the continuations of several occurrences of the matched n-gram, drafted as one tree.

    With a request `context` (a separate document), each n-gram length is looked up in the history first, then in
    the context (indexed once per request, ContextIndex), so a 3-gram found only in the context beats a 1-gram of
    the history. Context copies have the source "context"."""

    SOURCES = (LOOKUP_SOURCE, CONTEXT_SOURCE)

    def __init__(self, num_tokens: int = DEFAULTS.lookup_tokens, max_ngram: int = DEFAULTS.max_ngram,
                 min_ngram: int = DEFAULTS.min_ngram, adaptive: bool = DEFAULTS.adaptive,
                 candidates: int = DEFAULTS.candidates):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.length = DraftLength(num_tokens, adaptive=adaptive)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.candidates = candidates
        self.context: ContextIndex | None = None
        self._buffer = np.zeros(0, dtype=np.int64)
        self._size = 0

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        context = request.context_ids if request is not None else None
        self.context = ContextIndex(context) if context else None

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
        history = self._as_array(tokens)
        length = min(self.length.current, max_tokens)
        if length <= 0:
            return empty_draft()
        if self.candidates == 1 and self.context is None:
            found = find_prompt_lookup_draft(history, self.max_ngram, self.min_ngram, length)
            return copy_draft([found], [LOOKUP_SOURCE], max_tokens) if found else empty_draft()
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            branches = history_continuations(history, n, length, self.candidates)
            sources = [LOOKUP_SOURCE] * len(branches)
            if len(branches) < self.candidates and self.context is not None:
                more = [c for c in self.context.continuations(history[-n:], length, self.candidates)
                        if c not in branches][: self.candidates - len(branches)]
                branches += more
                sources += [CONTEXT_SOURCE] * len(more)
            if branches:
                return copy_draft(branches, sources, max_tokens)
        return empty_draft()

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        if draft.source in self.SOURCES:
            self.length.update(draft.max_depth, num_accepted)
