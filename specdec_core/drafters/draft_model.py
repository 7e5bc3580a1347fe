"""Draft-model drafter: a same-vocabulary model proposes δ tokens autoregressively, for all its rows at once.

Every row's drafter belongs to one `DraftModelPool`, which owns the draft model's `SlotKVCache` (one slot per row).
Inside the batched loop the pool collects the step's requests (`propose` returns a draft to be filled) and
`flush()` drafts them together: one batched catch-up forward over what each row's cache lacks, then one batched
forward per draft position. Outside a loop (`collecting` off) a propose drafts its own row at once.

A row's draft cache follows the accepted sequence lazily: it keeps the longest prefix it shares with the accepted
tokens (rejected draft tokens are rolled back by a length change) and feeds only what is new. That also covers
steps where another drafter (CopySpec in `copyspec+draft`) drafted and this one sat idle.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..loop.kv_cache import new_slot_cache
from ..loop.sampling import logits_to_probs, sample
from ..method_options import DEFAULT_DRAFT_TOKENS, DEFAULTS
from ..model.lm_head import SubsetHead
from ..model.model_runner import ModelRunner
from ..model.step_batch import StepBatch
from .base import Draft, Drafter, DraftPool, RequestContext
from .draft_length import DraftLength

if TYPE_CHECKING:
    from ..loop.speculation_budget import DraftPricing

SOURCE = "draft_model"
LONG_BACKLOG = 16  # catch-up tokens past which a row is fed alone
CAPACITY_SLACK = 64  # positions past the accepted sequence for drafted tokens (δ <= max_draft_tokens <= this)


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    end = min(len(a), len(b))
    i = start
    while i < end and a[i] == b[i]:
        i += 1
    return i


@dataclass
class DraftRequest:
    """One row's ask of the pool, and what the flush made of it: the drafter keeps it to learn from its verification
    (the pool writes nothing onto drafters)."""

    drafter: "PooledDrafter"
    tokens: Sequence[int]
    budget: int  # most tokens to draft (the drafter's length; the step's plan may lower it, `cap`)
    draft: Draft  # filled in place by flush()
    asked: int = 0  # the drafter's length: what it would have drafted, had neither the plan nor the request's end cut
    extra: int = 0  # drafter tokens drafted past the budget that add no verified token (SLEM's token healing)
    probs: list[torch.Tensor] = field(default_factory=list)  # q of each drafted token, when sampling
    # The plan or the request's end stopped the drafting (not the drafter's own stop): a fully accepted draft then
    # says nothing about a longer one.
    cut_by_plan: bool = False
    # The drafter's own stop (a confidence rule, slem) ended the draft before its length did: the draft then says
    # nothing about the length, accepted or not.
    stopped_itself: bool = False


@dataclass
class _SlotTokens:
    """What one row's draft-cache slot holds."""

    tokens: list[int] = field(default_factory=list)  # whose keys/values the slot holds
    synced: int = 0  # tokens[:synced] is known to equal the accepted sequence


class DraftModelPool(DraftPool):
    """The draft model's rows: a slot cache, and each row's record of which tokens its slot holds."""

    def __init__(self, runner: ModelRunner, pricing: "DraftPricing | None" = None):
        self.runner = runner
        self.pricing = pricing  # the decoder's (its budget's): the confidence stop reads it, the pool times into it
        self.cache = new_slot_cache(runner)
        self.owners: list[PooledDrafter] = []  # owners[i] holds cache row i
        self.slots: list[_SlotTokens] = []  # slots[i]: what cache row i holds
        self._pending: list[DraftRequest] = []
        self._pending_by_draft: dict[int, DraftRequest] = {}  # id(draft) -> its request: the loop looks each row's up

    # ------------------------------------------------------------------------------------------- rows
    def attach(self, drafter: "PooledDrafter") -> None:
        """Give a drafter an empty slot (its request starts); a drafter restarted on a new request gets a new one."""
        self.release(drafter)
        self.cache.fit(len(self.owners) + 1, max(self.cache.capacity, 1))
        self.cache.add_row()
        self.owners.append(drafter)  # cache row i <-> owners[i] <-> slots[i], all packed the same way
        self.slots.append(_SlotTokens())

    def release(self, drafter: "PooledDrafter") -> None:
        if drafter not in self.owners:
            return
        row = self.owners.index(drafter)
        self.cache.remove_row(row)
        last, last_slot = self.owners.pop(), self.slots.pop()
        if row < len(self.owners):
            self.owners[row], self.slots[row] = last, last_slot

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.cache.capacity:
            self.cache.fit(len(self.owners), needed)

    # ------------------------------------------------------------------------------------------- drafting
    def request(self, drafter: "PooledDrafter", tokens: Sequence[int], budget: int, extra: int = 0,
                length: int | None = None) -> DraftRequest:
        """Ask for up to `budget` tokens after `tokens` (+ `extra` that add no verified token); `length`: what the
        drafter would draft uncut (default `budget`). -> the request, whose draft flush() fills in place."""
        asked = budget if length is None else max(budget, length)
        ask = DraftRequest(drafter, tokens, budget, Draft(tokens=[], source=SOURCE), asked=asked, extra=extra)
        self._pending.append(ask)
        self._pending_by_draft[id(ask.draft)] = ask
        if not self.collecting:
            self.flush()
        return ask

    def requested(self, draft: Draft) -> int | None:
        pending = self._pending_by_draft.get(id(draft))
        return pending.budget if pending is not None else None

    def cap(self, draft: Draft, tokens: int) -> None:
        pending = self._pending_by_draft.get(id(draft))
        if pending is not None:
            pending.budget = min(pending.budget, max(0, tokens))

    def flush(self) -> None:
        """Draft every collected request: one catch-up forward, then one forward per draft position."""
        # A drafter whose row was retired since it asked has no slot left: its request goes with it.
        attached = {id(d) for d in self.owners}
        pending, self._pending = [p for p in self._pending if id(p.drafter) in attached], []
        self._pending_by_draft = {}
        for p in pending:
            p.cut_by_plan = p.budget < p.asked  # until drafting shows the cap was not reached
        pending = [p for p in pending if p.budget > 0]
        if not pending:
            return
        rows = [self.owners.index(p.drafter) for p in pending]
        head = self.head_for(pending)
        logits = self._catch_up(pending, rows, head)  # [b, vocab]
        active = list(range(len(pending)))
        while active:
            fed_rows, fed_tokens = [], []
            if self.pricing is not None:
                self.pricing.drafting_rows = len(active)  # who shares the next forward, as far as is known now
            for i in active:
                p = pending[i]
                token, more = p.drafter.choose(logits[i], p.probs)
                if token is None:  # the drafter cannot draft here: the draft ends before this position
                    continue
                p.draft.tokens.append(token)
                if more and len(p.draft.tokens) < p.budget + p.extra:
                    fed_rows.append(i)
                    fed_tokens.append(token)
            active = fed_rows
            if not active:
                break
            # Feed each still-drafting row its newest token: one [b, 1] forward.
            cache_rows = [rows[i] for i in active]
            started = time.perf_counter()
            step = self._forward(cache_rows, [[t] for t in fed_tokens], head)
            if self.pricing is not None:
                self.pricing.record_forward(time.perf_counter() - started)
            for j, i in enumerate(active):
                self.slots[rows[i]].tokens.append(fed_tokens[j])
            logits = torch.zeros(len(pending), step.shape[-1])
            logits[active] = step
        for p in pending:
            if p.probs:
                p.draft.probs = torch.stack(p.probs)  # [k, vocab] when sampling
            # Cut by the plan only if drafting went on to the cap (the drafter's own stop may have come first).
            p.stopped_itself = len(p.draft.tokens) < p.budget + p.extra
            p.cut_by_plan = p.cut_by_plan and not p.stopped_itself

    def head_for(self, pending: list[DraftRequest]) -> SubsetHead | None:
        """The LM head this flush's forwards use: the whole vocabulary here (cross_vocab_model.py may restrict it)."""
        return None

    def _catch_up(self, pending: list[DraftRequest], rows: list[int], head: SubsetHead | None = None) -> torch.Tensor:
        """Roll each row's slot back to what it shares with the accepted tokens and feed the rest (>= 1 token,
        the last accepted one, whose logits give the first draft token). -> [b, vocab]

        Rows with a long backlog (a new request's prompt) are fed alone, like a prefill: batched with rows that
        lack one token, they would pad every row to the backlog's length."""
        new_tokens = []
        for p, row in zip(pending, rows):
            slot = self.slots[row]
            keep = min(common_prefix_length(slot.tokens, p.tokens, slot.synced), len(p.tokens) - 1)
            self.cache.set_length(row, keep)
            new_tokens.append(list(p.tokens[keep:]))
            slot.tokens, slot.synced = list(p.tokens), len(p.tokens)
        longest_keep = max(self.cache.lengths[r] for r in rows)
        self._ensure_capacity(longest_keep + max(len(t) for t in new_tokens) + CAPACITY_SLACK)
        logits: list[torch.Tensor | None] = [None] * len(rows)
        short = [i for i, t in enumerate(new_tokens) if len(t) <= LONG_BACKLOG]
        for i in (i for i, t in enumerate(new_tokens) if len(t) > LONG_BACKLOG):
            started = time.perf_counter()
            logits[i] = self._forward([rows[i]], [new_tokens[i]], head)[0]
            if self.pricing is not None:
                self.pricing.record_prefill(time.perf_counter() - started)
        if short:
            batch = self._forward([rows[i] for i in short], [new_tokens[i] for i in short], head)
            for j, i in enumerate(short):
                logits[i] = batch[j]
        return torch.stack(logits)

    def _forward(self, rows: list[int], new_tokens: list[list[int]], head: SubsetHead | None = None) -> torch.Tensor:
        """Feed each row its new tokens (padded to one width), commit them; -> [b, vocab] after each row's last."""
        width = max(len(t) for t in new_tokens)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        visible = torch.zeros(len(rows), width, width, dtype=torch.bool)
        chain = torch.ones(width, width, dtype=torch.bool).tril()
        lengths = torch.tensor([self.cache.lengths[r] for r in rows])
        for b, tokens in enumerate(new_tokens):
            input_ids[b, : len(tokens)] = torch.tensor(tokens)
            visible[b, : len(tokens), : len(tokens)] = chain[: len(tokens), : len(tokens)]
        positions = lengths[:, None] + torch.arange(width)  # [b, T]
        index = torch.tensor([(b, len(t) - 1) for b, t in enumerate(new_tokens)])
        logits = self.runner.forward_slots(self.cache, StepBatch(input_ids, positions, visible, index, rows=rows),
                                           head=head.for_rows(rows) if head is not None else None)
        for row, tokens in zip(rows, new_tokens):
            self.cache.set_length(row, self.cache.lengths[row] + len(tokens))
        return logits



def choose_token(request: RequestContext, logits: torch.Tensor, probs: list[torch.Tensor]) -> tuple[int, bool]:
    """The draft model's next token for a row: its argmax (greedy) or a draw from q, whose row is appended to `probs`
    for the verifier. -> (token, whether drafting may go on after it). logits: [vocab]."""
    if request.sampling.greedy:
        return int(torch.argmax(logits).item()), True
    q = logits_to_probs(logits, request.sampling)  # [vocab]
    probs.append(q)
    return sample(q, request.generator), True


class PooledDrafter(Drafter):
    """A row of a pooled draft model: what every such drafter shares (its pool slot, its adaptive length, and what
    it learns from a verification). Subclasses say what to request (`propose`) and how to pick a token (`choose`)."""

    def __init__(self, pool: DraftModelPool, num_tokens: int, adaptive: bool, max_tokens: int):
        self.pool = pool
        self.length = DraftLength(num_tokens, adaptive=adaptive, minimum=1, maximum=min(max_tokens, CAPACITY_SLACK),
                                  growth="step")
        # this step's request as the pool filled it (the loop may verify fewer of its draft's tokens); None: no draft
        self._asked: DraftRequest | None = None

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self.pool.attach(self)

    def _request(self, tokens: Sequence[int], budget: int, extra: int = 0) -> Draft:
        """Ask the pool for up to `budget` tokens after `tokens` (filled in place when the pool flushes), and
        `extra` more drafter tokens that add no verified token."""
        self._asked = self.pool.request(self, tokens, budget, extra, self.length.current) if budget > 0 else None
        return self._asked.draft if self._asked is not None else Draft(tokens=[], source=SOURCE)

    @abstractmethod
    def choose(self, logits: torch.Tensor, probs: list[torch.Tensor]) -> tuple[int | None, bool]:
        """The pool asks each row's drafter for its next draft token (logits [vocab]) -> (token, whether drafting
        may go on after it); None ends the draft before this position."""

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        asked = self._asked
        if draft.source != SOURCE or (asked is not None and asked.stopped_itself):
            return
        proposed = len(asked.draft.tokens) if asked is not None else None
        if asked is not None and asked.cut_by_plan:
            proposed += 1  # the plan ended the draft: the drafter would have gone on
        self.length.update(len(draft), num_accepted, proposed)

    def finish(self) -> None:
        self.pool.release(self)


class DraftModelDrafter(PooledDrafter):
    def __init__(self, draft_model: "ModelRunner | DraftModelPool", num_tokens: int = DEFAULT_DRAFT_TOKENS,
                 adaptive: bool = DEFAULTS.adaptive, max_tokens: int = DEFAULTS.max_draft_tokens):
        pool = draft_model if isinstance(draft_model, DraftModelPool) else DraftModelPool(draft_model)
        super().__init__(pool, num_tokens, adaptive, max_tokens)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        return self._request(tokens, min(self.length.current, max_tokens))

    def choose(self, logits: torch.Tensor, probs: list[torch.Tensor]) -> tuple[int | None, bool]:
        return choose_token(self.request, logits, probs)

    @property
    def cache_length(self) -> int:
        return self.pool.cache.lengths[self.pool.owners.index(self)]
