"""The one drafter contract: propose a draft, observe what the target accepted. Drafters never verify.

A drafter object serves ONE request (its state is per row: an index over that row's history, a draft model's KV
cache); heavy shared things such as a draft model's weights are passed in when it is built. The token sequence a
drafter sees is append-only: prompt + accepted tokens, the last of which the target has not consumed yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..draft_tree import chain_parents, depths


@dataclass
class Draft:
    """A chain of draft tokens, or a tree when `parents` is given (see draft_tree.py for the node numbering)."""

    tokens: list[int]
    source: str  # key of accepted_by_source: "copy", "lookup", "draft_model", ...
    from_context: bool = False  # tokens copied from the request's own prompt/history (count as copied_tokens)
    probs: torch.Tensor | None = None  # [len(tokens), vocab] q the tokens were sampled from; None = one-hot
    parents: list[int] | None = None  # tree: parent draft index of each token (-1 = the pending token)

    def __post_init__(self):
        if self.parents is not None:
            if len(self.parents) != len(self.tokens) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError("a draft tree needs one parent per token, each before its child (-1 = root)")
            if self.probs is not None:
                raise ValueError("draft trees are one-hot: probability-carrying drafts must be chains")
            if self.parents == chain_parents(len(self.tokens)):
                self.parents = None  # a one-branch tree is a chain

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
                     parents=self.parents[:length] if self.parents is not None else None)


EMPTY_SOURCE = "none"


def empty_draft() -> Draft:
    return Draft(tokens=[], source=EMPTY_SOURCE)


@dataclass
class RequestContext:
    """What a drafter may know about its request beyond the running token sequence."""

    prompt_len: int
    context_ids: list[int] | None = None  # a separate document to draw from (RAG / CASD), may exceed the prompt
    sampling: object = None  # SamplingParams; drafters that sample use it with the request's generator
    generator: torch.Generator | None = None


class DraftPool(ABC):
    """Drafts for many rows together (a draft model steps all its rows in one batched forward). While the loop
    collects a step's proposals (`collecting`), the pool's drafters return drafts that `flush()` fills in place."""

    collecting: bool = False

    @abstractmethod
    def flush(self) -> None:
        """Fill every draft requested since the last flush."""


class Drafter(ABC):
    """propose() returns at most max_tokens tokens to follow `tokens`; observe() learns from the verification.

    What a drafter needs beyond the token sequence is declared by class attributes, which the loop reads:
    """

    #: reads RequestContext.context_ids (a separate document to draft from)
    uses_context: bool = False
    #: may return trees (Draft.parents); the verifier then walks the tree
    proposes_trees: bool = False
    #: drafts through a shared pool that the loop flushes once per step (None: propose() drafts at once)
    pool: DraftPool | None = None

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        """Called once per request after prefill, with the prompt plus the first generated token."""
        self.request = request

    @abstractmethod
    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        """Draft up to max_tokens continuation tokens; an empty draft when there is nothing worth proposing."""

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        """`tokens` now ends with the accepted draft tokens + one target token. Default: nothing to learn."""

    def finish(self) -> None:
        """The request is over (done, failed or cancelled): free what the drafter holds. Default: nothing."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: never drafts, so every step is one target forward for one token."""

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        return empty_draft()
