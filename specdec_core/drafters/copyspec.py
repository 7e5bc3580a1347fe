"""CopySpec drafter: when the last γ tokens occurred earlier in the history, copy the m tokens that followed them.

The index covers the whole history (prompt, earlier turns, generated tokens) and is brought up to date with only
the newly accepted tokens, O(γ) each; the match is re-checked after every step (paper §3.2).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Draft, Drafter, RequestContext, empty_draft
from .copyspec_index import CopyIndex
from .draft_length import DraftLength


class CopySpecDrafter(Drafter):
    def __init__(self, gamma: int = 3, copy_tokens: int = 10, adaptive: bool = False, max_copy_tokens: int = 64):
        self.gamma = gamma
        self.length = DraftLength(copy_tokens, adaptive=adaptive, minimum=copy_tokens, maximum=max_copy_tokens)
        self.index = CopyIndex(gamma)

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self.index = CopyIndex(self.gamma)
        self.index.extend(tokens)

    def _sync(self, tokens: Sequence[int]) -> None:
        # The sequence is append-only, so only the tail past what is indexed is new.
        if len(tokens) > len(self.index):
            self.index.extend(tokens[len(self.index) :])

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        self._sync(tokens)
        copied = self.index.copy_candidate(min(self.length.current, max_tokens))
        if not copied:
            return empty_draft()
        return Draft(tokens=copied, source="copy", from_context=True)

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        self._sync(tokens)
        if draft.source == "copy":
            self.length.update(len(draft), num_accepted)
