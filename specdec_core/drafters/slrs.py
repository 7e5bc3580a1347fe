"""SLRS (Timor et al., Algorithm 3), string-level rejection sampling, with a ONE-token lookahead.

At each draft position the drafter samples a token d from q; its text, tokenized alone with the target's tokenizer,
starts with the candidate target token t = first(d) (a precomputed map over the drafter's vocabulary:
vocab_mapping.build_first_tokens). The probability that this procedure yields t is

    psi(t) = sum over draft tokens d with first(d) = t of q(d)          (one scatter-add of q per position)

and the standard speculative-sampling verifier, handed psi as the draft distribution, accepts t with
min(1, p(t) / psi(t)) and otherwise draws from max(0, p - psi): lossless at any temperature (Theorem 3.2). A draft
token whose text is no target text on its own (a partial UTF-8 byte) goes to the OUTSIDE column, always rejected,
as in the union baseline. Unlike TLI, a drafter token longer than any shared one still lends its mass to its first
target token ('hello_world' counts for 'hello').

Chains: drafting goes on after t only when d's text IS t's text (then the drafter's context is right as fed);
otherwise the draft ends at t (the target samples the next position itself). Greedy drafts argmax psi, fed back as
the drafter token with t's text when there is one.

Not built: §3.3's deeper lookahead (sampling several draft tokens before choosing t). With the threshold lookahead
psi(t) sums over every draft continuation of every length-<=K prefix of t's text, and the paper's cheaper stopping
rule ("the first target token is determined") has no exact test for a BPE target, whose first token can change as
text is appended (decisions.md: specdec_core/drafters/slrs.py).
"""

from __future__ import annotations

import torch

from ..loop.sampling import logits_to_probs, sample
from .base import Draft
from .cross_vocab import outside_id
from .cross_vocab_model import CrossVocabDrafter


class SlrsDrafter(CrossVocabDrafter):
    def propose(self, tokens, max_tokens: int) -> Draft:
        self._targets: list[int] = []  # the candidate target token of each drafted position, in order
        return super().propose(tokens, max_tokens)

    def string_distribution(self, q: torch.Tensor) -> torch.Tensor:
        """q [|D|] -> psi [|T| + 1]: each draft token's mass on its first target token (OUTSIDE: none)."""
        outside = outside_id(self.pool.mapping)
        if getattr(self, "_columns", None) is None:  # once per request, not per drafted token: -1 -> OUTSIDE
            first = self.pool.first_tokens
            self._columns = torch.where(first >= 0, first, torch.full_like(first, outside))
        index = self._columns[: q.shape[-1]]  # [|D|]
        return torch.zeros(outside + 1, dtype=q.dtype).index_add_(0, index, q[: len(index)])

    def choose(self, logits: torch.Tensor, probs: list[torch.Tensor]) -> tuple[int | None, bool]:
        mapping, sampling = self.pool.mapping, self.request.sampling
        if sampling.greedy:
            psi = self.string_distribution(torch.softmax(logits.float(), dim=-1))
            target = int(torch.argmax(psi[:-1]))
            fed = int(mapping.target_to_draft[target])  # the drafter token with t's text, if it has one
            self._targets.append(target)
            # 0 is a placeholder that is never fed (drafting ends): translate() proposes t itself
            return (fed, self.sure_of(logits, fed)) if fed >= 0 else (0, False)
        q = logits_to_probs(logits, sampling)  # [|D|]
        token = sample(q, self.request.generator)
        probs.append(self.string_distribution(q))
        first = int(self.pool.first_tokens[token])
        self._targets.append(first if first >= 0 else outside_id(mapping))
        return token, first >= 0 and int(mapping.draft_to_target[token]) == first and self.sure_of(logits, token)

    def translate(self, draft: Draft) -> None:
        limit = self._step[3] if self._step is not None else len(draft.tokens)
        draft.tokens[:] = self._targets[: min(len(draft.tokens), limit)]
        if draft.probs is not None:
            draft.probs = draft.probs[: len(draft.tokens)]
