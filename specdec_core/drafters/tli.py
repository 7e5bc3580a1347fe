"""TLI (Timor et al., Algorithm 4) and the union baseline (Algorithm 1) in the batched loop: a draft model with
another tokenizer samples token by token from a distribution put onto the target's vocabulary (cross_vocab.py), and
the standard speculative-sampling verifier keeps the output the target's own, at any temperature.

Both draft one drafter token per target token, so the draft needs no re-tokenization: each drafted id maps to one
target id (mapping.draft_to_target). The accepted target tokens are carried back into the drafter's tokens through
the text, as SLEM does (CrossVocabDrafter): a target may emit tokens the drafter lacks.

- TLI: greedy drafts the argmax over the shared tokens; sampling draws from q'' (q restricted to the shared tokens,
  renormalised) and hands the verifier q'' rows of the target's width. Where q has no mass on a shared token the
  draft ends before that position (the target then samples it from p itself: still exact).
- union: greedy drafts the drafter's argmax and ends the draft before a token the target lacks (the target could
  never accept it); sampling draws from q over the drafter's whole vocabulary, hands the verifier q' rows with the
  OUTSIDE column, and after a drawn token the target lacks (sent as the OUTSIDE id, always rejected, replaced from
  max(0, p - q')) stops drafting: nothing after a certain rejection can be accepted.
"""

from __future__ import annotations

import torch

from ..loop.sampling import logits_to_probs, sample
from .base import Draft
from .cross_vocab import outside_id, tli_distribution, union_distribution
from .cross_vocab_model import CrossVocabDrafter


class TliDrafter(CrossVocabDrafter):
    """Token-level intersection: the drafter only ever proposes tokens both vocabularies have."""

    # q'' is q restricted to the shared tokens and renormalised: exactly the softmax of the shared-token head.
    head_tokens = "shared"

    def choose(self, logits: torch.Tensor, probs: list[torch.Tensor]) -> tuple[int | None, bool]:
        mapping = self.pool.mapping
        sampling = self.request.sampling
        if sampling.greedy:
            if getattr(self, "_shared", None) is None:  # once per request, not per drafted token
                shared, _ = mapping.shared_pairs  # draft ids [S]
                self._shared = shared[shared < logits.shape[-1]]
            token = int(self._shared[torch.argmax(logits[self._shared])])
            return token, self.sure_of(logits, token)
        q = logits_to_probs(logits, sampling)  # [|D|]
        on_target = tli_distribution(_full_width(q, len(mapping.draft_to_target)), mapping)  # [|T|] or None
        if on_target is None:
            return None, False
        target = sample(on_target, self.request.generator)
        probs.append(on_target)
        token = int(mapping.target_to_draft[target])
        return token, self.sure_of(logits, token)

    def translate(self, draft: Draft) -> None:
        draft_to_target = self.pool.mapping.draft_to_target
        outside = outside_id(self.pool.mapping)
        ids = [int(draft_to_target[t]) for t in draft.tokens]
        draft.tokens[:] = [t if t >= 0 else outside for t in ids]
        if self._step is not None and len(draft.tokens) > self._step[3]:  # never past the loop's limit
            del draft.tokens[self._step[3]:]
            draft.probs = draft.probs[: self._step[3]] if draft.probs is not None else None


class UnionDrafter(TliDrafter):
    """The union-of-vocabularies baseline (Theorem 4.1's comparison): the drafter proposes from its whole vocabulary."""

    head_tokens = "all"  # q' keeps the mass of tokens the target lacks (the OUTSIDE column)

    def choose(self, logits: torch.Tensor, probs: list[torch.Tensor]) -> tuple[int | None, bool]:
        mapping = self.pool.mapping
        sampling = self.request.sampling
        if sampling.greedy:
            token = int(torch.argmax(logits).item())
            return (token, self.sure_of(logits, token)) if mapping.draft_to_target[token] >= 0 else (None, False)
        q = logits_to_probs(logits, sampling)  # [|D|]
        token = sample(q, self.request.generator)
        probs.append(union_distribution(_full_width(q, len(mapping.draft_to_target)), mapping))  # [|T| + 1]
        return token, bool(mapping.draft_to_target[token] >= 0) and self.sure_of(logits, token)


def _full_width(q: torch.Tensor, width: int) -> torch.Tensor:
    """A drafter whose logits are narrower than its tokenizer (added tokens past the embedding): zero mass there."""
    return q if q.shape[-1] >= width else torch.nn.functional.pad(q, (0, width - q.shape[-1]))
