"""PLD+ (Somasundaram et al., "PLD+: Accelerating LLM inference by leveraging language model artifacts", §4):
prompt lookup whose candidate occurrences are RANKED by what the target computed, instead of taking the first.

Candidates (eq. 1): every earlier position j whose token equals the last token x_t. PLD+ (h) (eq. 3) ranks them by
the cosine similarity between the layer-l hidden state at j - 1 and at t - 1 (x_t itself has no hidden state yet:
the target has not read it, which is exactly the engine's pending-token invariant), optionally keeping only those
above a threshold θ (App. B.3), and drafts the K tokens after the best one (§4.3).

The hidden states come from the verify forwards themselves: the loop hooks layer l and hands this drafter the states
of the positions it committed (observe_hidden), so a rejected draft's states never enter and nothing needs rolling
back. One layer is kept: [history, hidden] float32, unit-normalised on arrival so a score is one matrix-vector
product over the candidates.
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from ..method_options import DEFAULTS
from .base import ATTENTION, HIDDEN_STATES, Draft, Drafter, empty_draft
from .draft_length import DraftLength
from .induction_heads import load_or_discover, top_heads

HIDDEN_LOOKUP_SOURCE = "lookup"
UNRANKED_SOURCE = "unranked"  # PLD+'s outline: the step's plan reads its length, nobody verifies it


# Which layer ranks best, as a fraction of the target's depth. The paper finds early-middle layers best (l = 9..13 of
# Vicuna's 32, §7.3). Tuned on the default model (SmolLM2, 30 layers) with benchmarks/tune_pld_plus.py, 8 requests,
# batch 8, every draft verified (benchmarks/results/issue9_tune_pld_plus_h_avx2_fp32.txt): mean accepted length over
# pld's at layers 2 / 5 / 9 / 14 / 20 / 27 was 1.03 / 1.02 / 1.03 / 1.07 / 1.07 / 1.05 on code edit (K = 10; K = 20
# alike) and 1.11 / 1.13 / 1.13 at 9 / 14 / 20 on summaries: the middle of the stack, layer 14 of 30. θ (0, 0.3, 0.6 or
# none) changed it by < 1 %.
DEFAULT_LAYER_FRACTION = 0.47


def default_hidden_layer(num_layers: int) -> int:
    return max(1, min(num_layers, round(DEFAULT_LAYER_FRACTION * num_layers)))


_rankings: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def head_ranking(target) -> dict:
    """The target's induction-head ranking: read from disk (or discovered and saved) once per loaded model."""
    ranking = _rankings.get(target)
    if ranking is None:
        ranking = _rankings[target] = load_or_discover(target)
    return ranking


def rank_by_hidden_state(history: np.ndarray, hidden: torch.Tensor, threshold: float | None) -> int | None:
    """PLD+ (h)'s choice of occurrence (eq. 1 + eq. 3), or None.

    history [t + 1] int64: the tokens, the last one (x_t) pending. hidden [>= t, H]: unit-norm layer-l states of
    positions 0..t-1. Returns the j (1 <= j < t, x_j = x_t) maximising cos(H[j - 1], H[t - 1]), over candidates whose
    similarity exceeds `threshold` (None: no threshold); ties go to the earliest j.
    """
    t = len(history) - 1
    if t < 2 or len(hidden) < t:
        return None
    candidates = np.flatnonzero(history[1:t] == history[t]) + 1  # [C]: j - 1 >= 0 has a hidden state
    if len(candidates) == 0:
        return None
    scores = hidden[torch.from_numpy(candidates - 1)] @ hidden[t - 1]  # [C] cosine similarities
    best = int(torch.argmax(scores))  # the first maximum
    if threshold is not None and not float(scores[best]) > threshold:
        return None
    return int(candidates[best])


def _earliest_occurrence(history: np.ndarray) -> int | None:
    """The first j < t with history[j] == history[t] (t = the pending token's place), or None."""
    candidates = np.flatnonzero(history[:-1] == history[-1])
    return int(candidates[0]) if len(candidates) else None


class RankedLookupDrafter(Drafter):
    """PLD+'s shared drafting (§4.3): copy the K tokens after the occurrence that `_rank` picks from the history.
    Ranking reads the target and only chooses which copy, so it runs for the rows a step's plan drafts alone."""

    ranks_after_plan = True

    def __init__(self, num_tokens: int, adaptive: bool):
        self.length = DraftLength(num_tokens, adaptive=adaptive)
        self._tokens = np.zeros(0, dtype=np.int64)
        self._size = 0

    @abstractmethod
    def _rank(self, history: np.ndarray) -> int | None:
        """The occurrence j (history[j] == history[-1], j < len - 1) to copy after, or None: what (h) and (a)
        differ in."""

    def _as_array(self, tokens: Sequence[int]) -> np.ndarray:
        # A growing numpy copy (the sequence is append-only): each step converts only the new tokens.
        size = len(tokens)
        if size > len(self._tokens):
            grown = np.zeros(max(2 * len(self._tokens), size, 1024), dtype=np.int64)
            grown[: self._size] = self._tokens[: self._size]
            self._tokens = grown
        self._tokens[self._size : size] = tokens[self._size :]
        self._size = size
        return self._tokens[:size]

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        return self._copy(tokens, max_tokens, self._rank, HIDDEN_LOOKUP_SOURCE)

    def outline(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        """The copy after the earliest occurrence of the last token: the longest any ranking can pick."""
        return self._copy(tokens, max_tokens, _earliest_occurrence, UNRANKED_SOURCE)

    def _copy(self, tokens: Sequence[int], max_tokens: int, pick, source: str) -> Draft:
        """The draft tokens after the occurrence pick(history) chooses (None: no draft)."""
        length = min(self.length.current, max_tokens)
        if length <= 0:
            return empty_draft()
        history = self._as_array(tokens)
        best = pick(history)
        if best is None:
            return empty_draft()
        return Draft(tokens=history[best + 1 : best + 1 + length].tolist(), source=source, from_context=True)

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        if draft.source == HIDDEN_LOOKUP_SOURCE:
            self.length.update(draft.max_depth, num_accepted)


class HiddenStateLookupDrafter(RankedLookupDrafter):
    """PLD+ (h): lossless (it only chooses what to draft); greedy and sampling both verify as usual."""

    reads = frozenset({HIDDEN_STATES})

    def __init__(self, hidden_layer: int | None = DEFAULTS.hidden_layer, num_tokens: int = DEFAULTS.lookup_tokens,
                 threshold: float | None = DEFAULTS.similarity_threshold, adaptive: bool = DEFAULTS.adaptive):
        if hidden_layer is not None and hidden_layer < 0:
            raise ValueError(f"hidden layer must be >= 0, got {hidden_layer}")
        super().__init__(num_tokens, adaptive)
        self.hidden_layer = hidden_layer  # None: default_hidden_layer() of the target, at admission (prepare)
        self.threshold = threshold
        self._hidden = torch.zeros(0, 0)  # [capacity, H] unit-norm states of the committed positions
        self._count = 0

    def prepare(self, target) -> None:
        if self.hidden_layer is None:
            self.hidden_layer = default_hidden_layer(target.num_layers)

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        new = torch.nn.functional.normalize(hidden.float(), dim=-1)  # [m, H]
        needed = self._count + len(new)
        if needed > len(self._hidden):
            grown = torch.zeros(max(2 * len(self._hidden), needed, 256), new.shape[1])
            if self._count:
                grown[: self._count] = self._hidden[: self._count]
            self._hidden = grown
        self._hidden[self._count : needed] = new
        self._count = needed

    def _rank(self, history: np.ndarray) -> int | None:
        return rank_by_hidden_state(history, self._hidden[: self._count], self.threshold)

    def finish(self) -> None:
        self._hidden = torch.zeros(0, 0)

def rank_by_attention(history: np.ndarray, weights: torch.Tensor) -> int | None:
    """PLD+ (a)'s choice of occurrence (eq. 1 + eq. 2), or None.

    history [t + 1] int64 (x_t pending); weights [t]: the max over the induction heads of their attention from the
    query at t - 1 (the one that produced x_t) over positions 0..t-1. Returns the j < t with x_j = x_t that got the
    most attention (the earliest on ties): an induction head attends to the token it copies. A lone candidate needs
    no weights (the loop computes none for it: AttentionLookupDrafter.wants_attention).
    """
    t = len(history) - 1
    if t < 1:
        return None
    candidates = np.flatnonzero(history[:t] == history[t])  # [C]
    if len(candidates) <= 1:
        return int(candidates[0]) if len(candidates) else None
    if len(weights) != t:
        return None
    return int(candidates[int(torch.argmax(weights[torch.from_numpy(candidates)]))])


class AttentionLookupDrafter(RankedLookupDrafter):
    """PLD+ (a): the engine supplies the attention of the target's top induction heads (discovered once per model,
    induction_heads.py) and this drafter copies after the occurrence they attend to most. Lossless."""

    reads = frozenset({ATTENTION})

    def __init__(self, num_tokens: int = DEFAULTS.lookup_tokens, top_heads: int = DEFAULTS.top_heads,
                 adaptive: bool = DEFAULTS.adaptive):
        if top_heads < 1:
            raise ValueError(f"top heads must be >= 1, got {top_heads}")
        super().__init__(num_tokens, adaptive)
        self.top_heads = top_heads
        self.attention_heads = None  # the target's top_heads induction heads, at admission (prepare)
        self._weights = torch.zeros(0)

    def prepare(self, target) -> None:
        if self.attention_heads is None:
            self.attention_heads = top_heads(head_ranking(target), self.top_heads)

    def wants_attention(self, tokens: Sequence[int]) -> bool:
        history = self._as_array(tokens)
        return len(history) > 1 and np.count_nonzero(history[:-1] == history[-1]) > 1  # a choice to rank

    def observe_attention(self, weights: torch.Tensor) -> None:
        self._weights = weights

    def _rank(self, history: np.ndarray) -> int | None:
        return rank_by_attention(history, self._weights)
