"""The one drafter contract: propose a draft, observe what the target accepted. Drafters never verify.

A drafter object serves ONE request (its state is per row: an index over that row's history, a draft model's KV
cache); heavy shared things such as a draft model's weights are passed in when it is built. The token sequence a
drafter sees is append-only: prompt + accepted tokens, the last of which the target has not consumed yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..loop.draft_tree import build_trie_with_origins, chain_parents, depths

if TYPE_CHECKING:
    from .job_memory import JobMemory
    from ..loop.speculation_budget import DraftPricing


@dataclass
class Draft:
    """A chain of draft tokens, or a tree when `parents` is given (see draft_tree.py for the node numbering)."""

    tokens: list[int]
    source: str  # key of accepted_by_source: "copy", "lookup", "draft_model", ...
    from_context: bool = False  # tokens copied from the request's own prompt/history (count as copied_tokens)
    probs: torch.Tensor | None = None  # [len(tokens), vocab] q the tokens were sampled from; None = one-hot
    parents: list[int] | None = None  # tree: parent draft index of each token (-1 = the pending token)
    # Per-token source when one draft mixes sources (history and context branches of one tree); else `source`.
    token_sources: list[str] | None = None
    # Draft indices whose next-token logits the drafter reads (DRAFT_LOGITS in Drafter.reads): nodes it adds to learn
    # from the target's forward (SPECTRA's pool rows), verified like any other node.
    probes: list[int] | None = None
    # Each node's chance of being accepted as its drafter estimates it (a tree's node: its path's; siblings exclude
    # each other, so the draft's expected accepted tokens are their sum). The budget prices such a draft by it,
    # calibrated against what verification accepts, instead of by the row's geometric acceptance rate.
    confidence: list[float] | None = None

    def __post_init__(self):
        if self.parents is not None:
            if len(self.parents) != len(self.tokens) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError("a draft tree needs one parent per token, each before its child (-1 = root)")
            if self.probs is not None:
                raise ValueError("draft trees are one-hot: probability-carrying drafts must be chains")
            if self.parents == chain_parents(len(self.tokens)):
                self.parents = None  # a one-branch tree is a chain
        if self.confidence is not None and len(self.confidence) != len(self.tokens):
            raise ValueError("confidence needs one probability per draft token")
        if self.token_sources is not None:
            if len(self.token_sources) != len(self.tokens):
                raise ValueError("token_sources needs one source per draft token")
            if len(set(self.token_sources)) == 1:
                self.source, self.token_sources = self.token_sources[0], None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def max_depth(self) -> int:
        return max(depths(self.parents), default=0) if self.parents is not None else len(self.tokens)

    def truncated(self, length: int) -> "Draft":
        """The first `length` tokens (a tree's first nodes are a tree: parents come before children)."""
        if length >= len(self.tokens):
            return self
        if length <= 0:
            return empty_draft()
        return Draft(tokens=self.tokens[:length], source=self.source, from_context=self.from_context,
                     probs=self.probs[:length] if self.probs is not None else None,
                     parents=self.parents[:length] if self.parents is not None else None,
                     token_sources=self.token_sources[:length] if self.token_sources is not None else None,
                     probes=[p for p in self.probes if p < length] if self.probes is not None else None,
                     confidence=self.confidence[:length] if self.confidence is not None else None)

    def probe_nodes(self) -> set[int]:
        """The draft indices on the branches that end at a probe (root to probe): nodes verified to learn from, not
        expected to be accepted."""
        nodes: set[int] = set()
        for probe in self.probes or ():
            node = probe
            while node >= 0 and node not in nodes:
                nodes.add(node)
                node = self.parents[node] if self.parents is not None else node - 1
        return nodes

    def source_of(self, index: int) -> str:
        return self.token_sources[index] if self.token_sources is not None else self.source


EMPTY_SOURCE = "none"

# What a drafter may read of the target's forwards (Drafter.reads):
HIDDEN_STATES = "hidden states"  # layer `hidden_layer` at each position the row commits (prefill and verify), through
#                                  observe_hidden()
ATTENTION = "attention"  # the weights of `attention_heads` from the newest committed token's query over every
#                          committed position, through observe_attention()
DRAFT_LOGITS = "draft logits"  # the target's next-token logits after the nodes a draft names in Draft.probes, from
#                                the verify forward itself, through observe_logits() (before observe())
CONTEXT_SOURCE = "context"  # copied from the request's separate `context` document (RequestContext.context_ids)


def copy_draft(branches: list[list[int]], sources: list[str], max_tokens: int) -> Draft:
    """A copy drafter's draft: one branch is a chain; several are merged into a tree whose nodes keep the source
    of the branch they came from. Every token is copied from the request's own text (counts as copied_tokens)."""
    if not branches:
        return empty_draft()
    if len(branches) == 1:
        return Draft(tokens=branches[0][:max_tokens], source=sources[0], from_context=True)
    tokens, parents, origins = build_trie_with_origins(branches)
    # Branches share what they have in common; the trie can exceed max_tokens nodes: keep the first ones.
    return Draft(tokens=tokens, source=sources[0], from_context=True, parents=parents,
                 token_sources=[sources[o] for o in origins]).truncated(max_tokens)


def empty_draft() -> Draft:
    return Draft(tokens=[], source=EMPTY_SOURCE)


@dataclass
class RequestContext:
    """What a drafter may know about its request beyond the running token sequence."""

    prompt_len: int
    context_ids: list[int] | None = None  # a separate document to draw from (RAG / CASD), may exceed the prompt
    sampling: object = None  # SamplingParams; drafters that sample use it with the request's generator
    generator: torch.Generator | None = None
    eos_token_ids: frozenset[int] = frozenset()  # the target's
    job_memory: "JobMemory | None" = None  # the outputs of the job's rows so far (job_memory.py); None: no memory
    tokens_left: int = 0  # the most tokens the row may still add: an index over it can be sized once, at start


class DraftPool(ABC):
    """Drafts for many rows together (a draft model steps all its rows in one batched forward). While the loop
    collects a step's proposals (inside `collecting_proposals()`), the pool's drafters return drafts that `flush()`
    fills in place; outside it a propose drafts its own row at once."""

    collecting: bool = False
    pricing: "DraftPricing | None" = None  # the decoder's running prices (speculation_budget.py), given at creation

    @contextmanager
    def collecting_proposals(self):
        self.collecting = True
        try:
            yield self
        finally:
            self.collecting = False

    @abstractmethod
    def flush(self) -> None:
        """Fill every draft requested since the last flush."""

    def requested(self, draft: Draft) -> int | None:
        """How many tokens `draft`, still to be filled by the next flush, may grow to (None: not pending here).
        The loop plans a step before flushing, from these lengths: each drafted token costs a drafter forward."""
        return None

    def cap(self, draft: Draft, tokens: int) -> None:
        """Let the pending `draft` grow to at most `tokens` tokens (what the step's plan will verify)."""


class Drafter(ABC):
    """propose() returns at most max_tokens tokens to follow `tokens`; observe() learns from the verification.

    What a drafter needs beyond the token sequence is declared by class attributes, which the loop reads:
    """

    #: drafts through a shared pool that the loop flushes once per step (None: propose() drafts at once)
    pool: DraftPool | None = None
    #: ever proposes a draft: False (plain decoding) lets the loop skip its proposal and its observe() calls
    proposes: bool = True
    #: what it reads of the target's own forwards besides tokens, a set of HIDDEN_STATES, ATTENTION and
    #: DRAFT_LOGITS (above); the loop captures only what a live row's drafter reads, so the others cost nothing
    reads: frozenset[str] = frozenset()
    hidden_layer: int | None = None  # HIDDEN_STATES: which layer (set per instance, by prepare())
    attention_heads: dict[int, list[int]] | None = None  # ATTENTION: {layer: [heads]} (set per instance)
    #: what it reads of the target chooses which tokens its draft holds, not how many (PLD+ ranks earlier copies):
    #: the loop calls outline() for the step's plan to read, and propose() only for the rows the plan lets verify
    #: some of their draft (an ATTENTION reader's weights are computed for those rows alone)
    ranks_after_plan: bool = False
    #: ends its drafts where one more token costs more than it returns (DraftPricing, set per instance): the step's
    #: plan then decides only whether the row drafts, not how far (its geometric acceptance model knows less)
    prices_its_length: bool = False
    #: has bookkeeping that no proposal of the running step needs (`while_verifying`): the loop runs it while the
    #: target verifies, so on a GPU it overlaps the device's step instead of adding to it
    works_while_verifying: bool = False

    def prepare(self, target) -> None:
        """Called once at admission, before the prompt is fed: take from the target (a ModelRunner) what this
        drafter needs of it, such as PLD+'s hidden layer and induction heads. Default: nothing."""

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        """Called once per request after prefill, with the prompt plus the first generated token."""
        self.request = request

    @abstractmethod
    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        """Draft up to max_tokens continuation tokens; an empty draft when there is nothing worth proposing."""

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        """`tokens` now ends with the accepted draft tokens + one target token. Default: nothing to learn."""

    def while_verifying(self, tokens: Sequence[int]) -> None:
        """works_while_verifying drafters only: called once a step, after the step's forward is launched and before
        its verdicts are read (every live row, drafting or not), with the row's tokens as they stand (nothing of the
        running step committed). Whatever it does reaches proposals from the next step on."""

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """HIDDEN_STATES readers only: [m, hidden] float32, layer `hidden_layer` at the m positions that just entered
        the target's cache (the prompt after prefill; the pending token + the accepted draft path after a step), in
        order. So after each step the drafter holds one state per token of `tokens` but the last (the pending one,
        which the target has not read yet), and a rejected draft's states are never handed over."""

    def observe_attention(self, weights: torch.Tensor) -> None:
        """ATTENTION readers only: [length] the max over `attention_heads` of their attention weights from the query at
        position length - 1 (the token that produced the pending one) over positions 0..length-1; after start()
        and after each step's observe(), where wants_attention(tokens) said so (`ranks_after_plan`: and the
        step's plan verifies some of the row's draft)."""

    def wants_attention(self, tokens: Sequence[int]) -> bool:
        """ATTENTION readers only: whether the next propose(tokens) reads the weights (computing them costs a pass
        over the row's keys in every chosen layer). Default: always."""
        return True

    def outline(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        """ranks_after_plan drafters: a draft at least as long as propose(tokens, max_tokens) would return, for the
        step's plan to read; never verified. Default: the proposal itself."""
        return self.propose(tokens, max_tokens)

    def observe_logits(self, probes: list[int], logits: torch.Tensor) -> None:
        """DRAFT_LOGITS readers only: [len(probes), vocab] the target's logits after each draft node in `probes` (the
        last draft's Draft.probes that the step verified, in order)."""

    def finish(self) -> None:
        """The request is over (done, failed or cancelled): free what the drafter holds. Default: nothing."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: never drafts, so every step is one target forward for one token."""

    proposes = False

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        return empty_draft()
