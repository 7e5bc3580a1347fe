"""The one drafter contract: propose a draft, observe what the target accepted. Drafters never verify.

A drafter object serves ONE request (its state is per row: an index over that row's history, a draft model's KV
cache); heavy shared things such as a draft model's weights are passed in when it is built. The token sequence a
drafter sees is append-only: prompt + accepted tokens, the last of which the target has not consumed yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    tokens: list[int]
    source: str  # key of accepted_by_source: "copy", "lookup", "draft_model", ...
    from_context: bool = False  # tokens copied from the request's own prompt/history (count as copied_tokens)
    probs: torch.Tensor | None = None  # [len(tokens), vocab] q the tokens were sampled from; None = one-hot

    def __len__(self) -> int:
        return len(self.tokens)


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
    extra: dict = field(default_factory=dict)


class Drafter(ABC):
    """propose() returns at most max_tokens tokens to follow `tokens`; observe() learns from the verification."""

    #: set by drafters that sample and return draft probabilities (verification then uses Leviathan's rule)
    returns_probabilities: bool = False

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        """Called once per request after prefill, with the prompt plus the first generated token."""
        self.request = request

    @abstractmethod
    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        """Draft up to max_tokens continuation tokens; an empty draft when there is nothing worth proposing."""

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        """`tokens` now ends with draft.tokens[:num_accepted] + one target token. Default: nothing to learn."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: never drafts, so every step is one target forward for one token."""

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        return empty_draft()
