"""CopySpec drafter: when the last γ tokens occurred earlier in the history, copy the m tokens that followed them.

The index covers the whole history (prompt, earlier turns, generated tokens) and is brought up to date with only
the newly accepted tokens, O(γ) each; the match is re-checked after every step (paper §3.2).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..draft_tree import build_trie
from .base import Draft, Drafter, RequestContext, empty_draft
from .copyspec_index import CopyIndex
from .draft_length import DraftLength


class CopySpecDrafter(Drafter):
    """candidates > 1: multi-candidate copying (not in the paper): the continuations of up to that many earlier
    occurrences of the suffix are drafted as branches of one tree, so a row whose first match goes wrong can still
    accept a long copy from another. The verifier accepts the longest matching path (lossless)."""

    proposes_trees = True

    def __init__(self, gamma: int = 3, copy_tokens: int = 10, adaptive: bool = False, max_copy_tokens: int = 64,
                 candidates: int = 1):
        self.gamma = gamma
        self.candidates = candidates
        self.length = DraftLength(copy_tokens, adaptive=adaptive, minimum=copy_tokens, maximum=max_copy_tokens)
        self.index = self._new_index()

    def _new_index(self) -> CopyIndex:
        return CopyIndex(self.gamma, keep_all=self.candidates > 1)

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self.index = self._new_index()
        self.index.extend(tokens)

    def _sync(self, tokens: Sequence[int]) -> None:
        # The sequence is append-only, so only the tail past what is indexed is new.
        if len(tokens) > len(self.index):
            self.index.extend(tokens[len(self.index) :])

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        self._sync(tokens)
        length = min(self.length.current, max_tokens)
        if self.candidates > 1:
            branches = self.index.copy_candidates(length, self.candidates)
            if not branches:
                return empty_draft()
            # Branches share what they have in common; the trie can exceed max_tokens nodes: keep the first ones.
            draft_tokens, parents = build_trie(branches)
            return Draft(tokens=draft_tokens, source="copy", from_context=True, parents=parents).truncated(max_tokens)
        copied = self.index.copy_candidate(length)
        if not copied:
            return empty_draft()
        return Draft(tokens=copied, source="copy", from_context=True)

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        self._sync(tokens)
        if draft.source == "copy":
            self.length.update(draft.max_depth, num_accepted)
