"""The one verification module: decides how much of a draft the target accepts, given ONE target forward.

Vocabulary (as in vLLM's rejection sampler):
  accepted tokens  - the draft prefix the target agrees with;
  recovered token  - drawn by the target at the first rejected position (greedy: its argmax; sampling: a draw from
                     the residual max(0, p - q), renormalised);
  bonus token      - drawn from the target after the last draft token when the whole draft is accepted.
Every verifier returns (num_accepted, next_token) where next_token is the recovered or the bonus token, so each
step emits num_accepted + 1 tokens.

Lossless: greedy verification reproduces the target's argmax sequence exactly; the sampling verifiers reproduce the
target distribution p exactly (Leviathan et al. 2023, Thm. 1), whatever the draft distribution q. Drafts without
probabilities (copying, lookup) are one-hot q: accept x with probability p(x), else resample from p with x removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, logits_to_probs, sample


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int  # accepted draft tokens, 0..len(draft)
    next_token: int  # recovered token (after a rejection) or bonus token (whole draft accepted)


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Longest draft prefix equal to the target's argmax ([k + 1] ids) -> (num_accepted, next_token). The batched
    loop calls this per row after one argmax over the whole batch's [N, vocab] logits."""
    num_accepted = 0
    for drafted, wanted in zip(draft_tokens, target_argmax):
        if drafted != wanted:
            break
        num_accepted += 1
    return num_accepted, target_argmax[num_accepted]


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> VerifyResult:
    """Accept the longest draft prefix equal to the target's argmax; target_logits is [k + 1, vocab]."""
    return VerifyResult(*accept_greedy(draft_tokens, torch.argmax(target_logits, dim=-1).tolist()))


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator).item())


def verify_speculative_sampling(
    draft_tokens: list[int],
    target_probs: torch.Tensor,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Leviathan speculative sampling; names follow the paper: p = target, q = draft.

    target_probs: [k + 1, vocab] p(. | prefix, x_1..x_i) for i = 0..k.
    draft_probs:  [k, vocab] q(. | ...) the drafter sampled x_i from, or None for one-hot drafts (q = delta_x).
    """
    vocab = target_probs.shape[-1]
    for i, x in enumerate(draft_tokens):
        p = target_probs[i]  # [vocab]
        # A drafter token the target cannot emit has p(x) = 0: always rejected, and the replacement still comes
        # from the residual max(p - q, 0) over the target's vocabulary (q's mass on x is what made x likely).
        p_x = float(p[x]) if x < vocab else 0.0
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        # accept with probability min(1, p(x) / q(x))
        if q_x > 0 and _uniform(generator) * q_x < p_x:
            continue
        if draft_probs is None:
            residual = p.clone()
            if x < vocab:
                residual[x] = 0.0  # max(0, p - delta_x)
        else:
            q = _match_width(draft_probs[i], vocab)
            residual = torch.clamp(p - q, min=0.0)
        total = float(residual.sum())
        # total == 0 only when p == q (then rejection has probability 0): fall back to p for float safety.
        return VerifyResult(i, sample(residual / total if total > 0 else p, generator))
    return VerifyResult(len(draft_tokens), sample(target_probs[len(draft_tokens)], generator))


def _match_width(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Same-tokenizer drafters may pad their embedding matrix differently from the target."""
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[:vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


def verify(
    draft_tokens: list[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """Dispatch on the request's sampling mode; target_logits is [k + 1, vocab] from one target forward."""
    if params.greedy:
        return verify_greedy(draft_tokens, target_logits)
    target_probs = logits_to_probs(target_logits, params)  # [k + 1, vocab]
    return verify_speculative_sampling(draft_tokens, target_probs, generator, draft_probs)
