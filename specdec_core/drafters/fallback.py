"""Try drafters in order and use the first non-empty draft (CopySpec §3.3: copy when the index matches, else draft)."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Draft, Drafter, RequestContext


class FallbackDrafter(Drafter):
    def __init__(self, drafters: list[Drafter]):
        if not drafters:
            raise ValueError("FallbackDrafter needs at least one drafter")
        self.drafters = drafters
        self.pool = next((d.pool for d in drafters if d.pool is not None), None)
        self.works_while_verifying = any(d.works_while_verifying for d in drafters)

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        for drafter in self.drafters:
            drafter.start(tokens, request)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        for drafter in self.drafters[:-1]:
            draft = drafter.propose(tokens, max_tokens)
            if draft.tokens:
                return draft
        # The last one's draft as it comes: a pooled draft model's is still empty here and filled by the pool.
        return self.drafters[-1].propose(tokens, max_tokens)

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        for drafter in self.drafters:
            drafter.observe(tokens, draft, num_accepted)

    def while_verifying(self, tokens: Sequence[int]) -> None:
        for drafter in self.drafters:
            if drafter.works_while_verifying:
                drafter.while_verifying(tokens)

    def finish(self) -> None:
        for drafter in self.drafters:
            drafter.finish()
