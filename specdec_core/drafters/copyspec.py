"""CopySpec drafter: when the last γ tokens occurred earlier in the history, copy the m tokens that followed them.

The index covers the whole history (prompt, earlier turns, generated tokens) and is brought up to date with only
the newly accepted tokens, O(γ) each; the match is re-checked after every step (paper §3.2).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..method_options import DEFAULTS
from .base import CONTEXT_SOURCE, Draft, Drafter, RequestContext, copy_draft
from .context_index import ContextIndex
from .copyspec_index import CopyIndex
from .draft_length import DraftLength

COPY_SOURCE = "copy"


class CopySpecDrafter(Drafter):
    """candidates > 1: multi-candidate copying (not in the paper): the continuations of up to that many earlier
    occurrences of the suffix are drafted as branches of one tree, so a row whose first match goes wrong can still
    accept a long copy from another. The verifier accepts the longest matching path (lossless).

    With a request `context` (a separate document, indexed once per request), the suffix is also looked up there
    when the history has fewer than `candidates` continuations (source "context")."""

    SOURCES = (COPY_SOURCE, CONTEXT_SOURCE)

    def __init__(self, gamma: int = DEFAULTS.gamma, copy_tokens: int = DEFAULTS.copy_tokens,
                 adaptive: bool = DEFAULTS.adaptive, max_copy_tokens: int = DEFAULTS.max_copy_tokens,
                 candidates: int = DEFAULTS.candidates):
        self.gamma = gamma
        self.candidates = candidates
        self.length = DraftLength(copy_tokens, adaptive=adaptive, minimum=copy_tokens, maximum=max_copy_tokens)
        self.index = self._new_index()
        self.context: ContextIndex | None = None

    def _new_index(self) -> CopyIndex:
        return CopyIndex(self.gamma, keep_all=self.candidates > 1)

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self.index = self._new_index()
        self.index.extend(tokens)
        context = request.context_ids if request is not None else None
        self.context = ContextIndex(context) if context else None

    def _sync(self, tokens: Sequence[int]) -> None:
        # The sequence is append-only, so only the tail past what is indexed is new.
        if len(tokens) > len(self.index):
            self.index.extend(tokens[len(self.index) :])

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        self._sync(tokens)
        length = min(self.length.current, max_tokens)
        if self.candidates > 1:
            branches = self.index.copy_candidates(length, self.candidates)
        else:
            branches = [found] if (found := self.index.copy_candidate(length)) else []
        sources = [COPY_SOURCE] * len(branches)
        if len(branches) < self.candidates and self.context is not None and len(self.index) >= self.gamma:
            suffix = self.index.tokens[len(self.index) - self.gamma :]
            more = [c for c in self.context.continuations(suffix, length, self.candidates)
                    if c not in branches][: self.candidates - len(branches)]
            branches += more
            sources += [CONTEXT_SOURCE] * len(more)
        return copy_draft(branches, sources, max_tokens)

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        # (the index catches up in propose: steps that rest from drafting never touch it)
        if draft.source in self.SOURCES:
            self.length.update(draft.max_depth, num_accepted)
