"""The `auto` cascade: per row and per step, the candidate drafter expected to give the most accepted tokens proposes.

Candidates, in order of preference on a tie: SuffixDecoding's trees (the request's own text and the job memory),
CopySpec's copy (the request's history and its `context` document), and a draft model when the engine has one.
Each row keeps, per candidate, a moving average of the tokens the target accepted when that candidate's draft was
verified: the row's expected accepted length. The copy drafters cost microseconds, so both propose every step and
the better expected one is drafted; the draft model costs forwards, so it is asked only when its expectation beats
the copies' (its draft is filled by the pool's flush). Only the chosen candidate's expectation learns: a candidate
that is never chosen keeps its prior, which is set so that each is tried before the row settles.
"""

from __future__ import annotations

from collections.abc import Sequence

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
        self.expected = [PRIOR_ACCEPTED] * len(candidates)  # per candidate: accepted tokens per verified draft
        self.chosen: int | None = None  # the candidate whose draft was proposed last

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self.expected = [PRIOR_ACCEPTED] * len(self.candidates)
        for drafter in self.candidates:
            drafter.start(tokens, request)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        best, best_value, self.chosen = empty_draft(), 0.0, None
        for index, drafter in enumerate(self.candidates):
            if drafter.pool is not None:
                if self.expected[index] > best_value:  # worth its forwards: ask the pool (filled at its flush)
                    best, self.chosen = drafter.propose(tokens, max_tokens), index
                break
            draft = drafter.propose(tokens, max_tokens)
            value = min(self.expected[index], draft.max_depth)  # a draft cannot give more than its depth
            if draft.tokens and value > best_value:
                best, best_value, self.chosen = draft, value, index
        return best

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        if self.chosen is not None and draft.tokens:
            previous = self.expected[self.chosen]
            self.expected[self.chosen] = (1 - SMOOTHING) * previous + SMOOTHING * num_accepted
        for drafter in self.candidates:
            drafter.observe(tokens, draft, num_accepted)

    def finish(self) -> None:
        for drafter in self.candidates:
            drafter.finish()
