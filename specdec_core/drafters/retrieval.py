"""REST-style retrieval drafting from a shared corpus index (`rest`; SPECTRA's external guesses).

The corpus is a RetrievalIndex (retrieval_index.py): built once, memory-mapped by every actor. Each step takes the
longest suffix of the running text (2..16 tokens) found in the corpus and merges the continuations of its
occurrences into a draft tree (the CASD drafter's retrieval, over the corpus instead of the row's context).
Verified exactly: lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..method_options import DEFAULTS
from .base import Draft, Drafter, RequestContext
from .casd import ContextTreeDrafter

RETRIEVAL_SOURCE = "retrieval"


class RetrievalTreeDrafter(ContextTreeDrafter):

    def __init__(self, corpus, node_budget: int = DEFAULTS.tree_nodes, depth: int = 10, max_match: int = 16,
                 min_match: int = 2, max_occurrences: int = 64):
        super().__init__(node_budget, depth, max_match, min_match, max_occurrences)
        self.corpus = corpus

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        Drafter.start(self, tokens, request)
        self.index, self.source = self.corpus, RETRIEVAL_SOURCE

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        draft = super().propose(tokens, max_tokens)
        return replace(draft, from_context=False) if len(draft) else draft  # not the request's own text

    def branches(self, tokens: Sequence[int], depth: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (≤ depth tokens) of the longest suffix match: SPECTRA's external
        guesses."""
        if limit <= 0:
            return []
        found: list[list[int]] = []
        for branch in self.retrieve(tokens, depth):
            if branch and branch not in found:
                found.append(branch)
                if len(found) == limit:
                    break
        return found
