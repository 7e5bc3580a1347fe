"""Draft-model drafter: a same-vocabulary model proposes δ tokens autoregressively with its own KV cache.

The drafter's cache follows the accepted sequence lazily: at each proposal it keeps the longest prefix it shares
with the accepted tokens (rejected draft tokens are cropped away) and feeds only what is new. That also covers
steps where another drafter (CopySpec in `copyspec+draft`) drafted and this one sat idle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model_runner import ModelRunner
from ..sampling import logits_to_probs, sample
from .base import Draft, Drafter, RequestContext
from .draft_length import DraftLength


def common_prefix_length(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    end = min(len(a), len(b))
    i = start
    while i < end and a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter(Drafter):

    def __init__(self, runner: ModelRunner, num_tokens: int = 4, adaptive: bool = False, max_tokens: int = 16):
        self.runner = runner
        self.length = DraftLength(num_tokens, adaptive=adaptive, minimum=1, maximum=max_tokens)
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values the draft cache holds
        self._synced = 0  # cached[:_synced] is known to equal the accepted sequence

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self.cache = self.runner.new_cache()
        self.cached = []
        self._synced = 0

    def _catch_up(self, tokens: Sequence[int]) -> torch.Tensor:
        """Bring the cache to tokens[:-1] + feed tokens[-1]; return the draft logits for the next position."""
        keep = common_prefix_length(self.cached, tokens, self._synced)
        keep = min(keep, len(tokens) - 1)  # the last token must be fed to get fresh logits
        self.runner.crop(self.cache, keep)
        new = list(tokens[keep:])
        out = self.runner.forward(self.cache, new, num_logits=1)
        self.cached = list(tokens)
        self._synced = len(tokens)
        return out.logits[0]  # [vocab]

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        budget = min(self.length.current, max_tokens)
        if budget <= 0:
            return Draft(tokens=[], source="draft_model")
        params = self.request.sampling
        logits = self._catch_up(tokens)
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            if params.greedy:
                token = int(torch.argmax(logits).item())
            else:
                q = logits_to_probs(logits, params)  # [vocab]
                token = sample(q, self.request.generator)
                probs.append(q)
            drafted.append(token)
            if len(drafted) == budget:
                break
            logits = self.runner.forward(self.cache, [token], num_logits=1).logits[0]
            self.cached.append(token)
        return Draft(
            tokens=drafted,
            source="draft_model",
            probs=torch.stack(probs) if probs else None,  # [k, vocab] when sampling
        )

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        if draft.source == "draft_model":
            self.length.update(len(draft), num_accepted)
