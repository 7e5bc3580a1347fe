"""The `auto` cascade: per row and per step, the candidate drafter expected to give the most accepted tokens proposes.

Candidates, in order of preference on a tie: SuffixDecoding's trees (the request's own text and the job memory),
CopySpec's copy (the request's history and its `context` document), and a draft model when the engine has one.
Each row keeps, per candidate, a moving average of the tokens the target accepted when that candidate's draft was
verified: the row's expected accepted length. The copy drafters cost microseconds, so both propose every step and
the better expected one is drafted; the draft model costs forwards, so it is asked only when its expectation beats
the copies' (its draft is filled by the pool's flush). The chosen candidate learns what the target accepted; a copy
candidate that was not chosen learns what its own draft would have had accepted, read off the tokens the step
committed: its draft's longest path along them. Where that path reaches the end of what is known (every committed
token, or its whole draft) the candidate might have done better, so the count only raises its expectation, never
lowers it; where the draft parts from the committed tokens the count is exact. The chosen candidate's count is
treated alike: a draft accepted whole (the plan may have cut it) only raises. So a candidate that would have beaten
the chosen one is seen to, and a row does not stay with a stale choice. A draft model that was not asked keeps its
expectation; the priors are set so that each is tried before the row settles.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..loop.verification import greedy_accepted
from .base import Draft, Drafter, RequestContext, empty_draft

PRIOR_ACCEPTED = 2.0  # tokens: above what a poor drafter earns, so a first try of each candidate is cheap to make
SMOOTHING = 0.3  # weight of the newest step in the moving average


class CascadeDrafter(Drafter):

    def __init__(self, candidates: list[Drafter]):
        if not candidates:
            raise ValueError("the cascade needs at least one candidate drafter")
        pooled = [d for d in candidates if d.pool is not None]
        if len(pooled) > 1 or (pooled and pooled[0] is not candidates[-1]):
            raise ValueError("the cascade takes one pooled drafter (a draft model), last")
        self.candidates = candidates
        self.pool = pooled[0].pool if pooled else None
        self.works_while_verifying = any(d.works_while_verifying for d in candidates)
        self.expected = [PRIOR_ACCEPTED] * len(candidates)  # per candidate: accepted tokens per verified draft
        self.chosen: int | None = None  # the candidate whose draft was proposed last
        self.proposed: list[Draft | None] = [None] * len(candidates)  # each copy candidate's last draft

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self.expected = [PRIOR_ACCEPTED] * len(self.candidates)
        for drafter in self.candidates:
            drafter.start(tokens, request)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        best, best_value, self.chosen = empty_draft(), 0.0, None
        self.proposed = [None] * len(self.candidates)
        for index, drafter in enumerate(self.candidates):
            if drafter.pool is not None:
                if self.expected[index] > best_value:  # worth its forwards: ask the pool (filled at its flush)
                    best, self.chosen = drafter.propose(tokens, max_tokens), index
                break
            draft = self.proposed[index] = drafter.propose(tokens, max_tokens)
            value = min(self.expected[index], draft.max_depth)  # a draft cannot give more than its depth
            if draft.tokens and value > best_value:
                best, best_value, self.chosen = draft, value, index
        return best

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        if self.chosen is not None and draft.tokens:
            if num_accepted < draft.max_depth or num_accepted > self.expected[self.chosen]:
                self._learn(self.chosen, num_accepted)
            committed = tokens[len(tokens) - num_accepted - 1:]  # the accepted draft tokens + the target's token
            for index, other in enumerate(self.proposed):
                if index != self.chosen and other is not None and other.tokens:
                    would = greedy_accepted(other, committed)
                    if would < min(other.max_depth, len(committed)) or would > self.expected[index]:
                        self._learn(index, would)
        for drafter in self.candidates:
            drafter.observe(tokens, draft, num_accepted)

    def _learn(self, index: int, accepted: int) -> None:
        self.expected[index] = (1 - SMOOTHING) * self.expected[index] + SMOOTHING * accepted

    def while_verifying(self, tokens: Sequence[int]) -> None:
        for drafter in self.candidates:
            if drafter.works_while_verifying:
                drafter.while_verifying(tokens)

    def finish(self) -> None:
        for drafter in self.candidates:
            drafter.finish()
