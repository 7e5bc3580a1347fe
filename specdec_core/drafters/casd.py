"""CASD (context-aware speculative decoding, §3 of the paper): draft trees retrieved from the request's own context.

The draft pool is the row's `context` (else its prompt), indexed once per request by a suffix array. Each step takes
the longest suffix of the running text (up to `max_match` tokens) that occurs in the pool, the `depth` tokens after
each of its occurrences (up to `max_occurrences`, spread evenly), and merges them into a trie whose `node_budget`
most frequent nodes form the draft tree: REST's exact-match retrieval (He et al., 2024), which the paper uses.

The tree is verified either exactly (`casd_strict`: lossless, greedy or sampling, the REST-style context tree) or by
the paper's conditional rule (`casd` / `casd_mixed`: lossy, greedy only): the method's spec chooses the rule
(methods.py, verification.ConditionalRule); the drafter only retrieves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..loop.draft_tree import frequency_trie
from ..method_options import DEFAULTS
from .base import CONTEXT_SOURCE, Draft, Drafter, RequestContext, empty_draft
from .suffix_array import SuffixArray, shared_suffix_array

PROMPT_POOL_SOURCE = "copy"  # a row without a context retrieves from its own prompt


class ContextTreeDrafter(Drafter):

    def __init__(self, node_budget: int = DEFAULTS.tree_nodes, depth: int = 10, max_match: int = 16, min_match: int = 2,
                 max_occurrences: int = 64):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.node_budget = node_budget
        self.depth = depth
        self.max_match = max_match
        self.min_match = min_match
        self.max_occurrences = max_occurrences
        self.index: SuffixArray | None = None  # the draft pool (not Drafter.pool: that is a draft-model pool)
        self.source = CONTEXT_SOURCE

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        if request.context_ids:
            self.index, self.source = shared_suffix_array(request.context_ids), CONTEXT_SOURCE
        else:
            self.index, self.source = SuffixArray(tokens[: request.prompt_len]), PROMPT_POOL_SOURCE

    def retrieve(self, tokens: Sequence[int], depth: int) -> list[list[int]]:
        """The `depth` tokens after each occurrence (up to max_occurrences) of the longest suffix of `tokens`
        (min_match..max_match tokens) in the pool; [] when none occurs."""
        if self.index is None:
            return []
        tail = np.asarray(tokens[-self.max_match :], dtype=np.int64)
        match = self.index.longest_suffix_match(tail, self.min_match)
        if match is None:
            return []
        length, lo, hi = match
        return self.index.continuations(lo, hi, length, depth, self.max_occurrences)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        budget = min(self.node_budget, max_tokens)
        if budget <= 0:
            return empty_draft()
        draft_tokens, parents = frequency_trie(self.retrieve(tokens, self.depth), budget)
        if not draft_tokens:
            return empty_draft()
        return Draft(tokens=draft_tokens, source=self.source, from_context=True, parents=parents)

    def finish(self) -> None:
        self.index = None
