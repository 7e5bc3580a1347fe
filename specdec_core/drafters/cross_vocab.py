"""A drafter's distribution over its own vocabulary D, put onto the target's vocabulary T so that the standard
speculative-sampling verifier (verification.verify_speculative_sampling, unchanged) stays lossless (Timor et al.).

- TLI (Algorithm 4): q''(x) = q(x) / sum_{t in T∩D} q(t) on the shared tokens, 0 elsewhere; the drafter samples
  from q'' and the target is verified as usual. Target tokens outside D keep their whole p in the residual
  max(0, p - q''), so every target token can still come out.
- Union baseline (Algorithm 1): q' = q on T∪D. A drafted token outside T has p'(x) = 0 and is always rejected; its
  replacement comes from max(0, p - q'|T). The draft is put on T's ids with one extra column, OUTSIDE = |T|, holding
  q's mass outside T: the verifier reads p(OUTSIDE) as 0 (an id past the target's vocabulary) and q(OUTSIDE) from
  that column, and its residual keeps only the first |T| columns.
Theorem 4.1: TLI's acceptance rate sum min(p, q'') is never below the union's sum min(p, q') (q'' >= q' on T).

The drafters that sample from these in the batched loop are drafters/tli.py.
"""

from __future__ import annotations

import torch

from .vocab_mapping import VocabMapping


def _target_index(mapping: VocabMapping, device) -> tuple[torch.Tensor, torch.Tensor]:
    draft_ids, target_ids = mapping.shared_pairs  # [S], [S]
    return draft_ids.to(device), target_ids.to(device)


def tli_distribution(q: torch.Tensor, mapping: VocabMapping) -> torch.Tensor | None:
    """q [..., |D|] -> q'' [..., |T|]; None when q puts no mass on a shared token (then TLI cannot draft here)."""
    draft_ids, target_ids = _target_index(mapping, q.device)
    shared = q[..., draft_ids]  # [..., S]
    total = shared.sum(dim=-1, keepdim=True)
    if bool((total <= 0).any()):
        return None
    out = torch.zeros(*q.shape[:-1], len(mapping.target_to_draft), dtype=q.dtype, device=q.device)
    return out.index_add_(-1, target_ids, shared / total)  # draft tokens with the same bytes add up


def union_distribution(q: torch.Tensor, mapping: VocabMapping) -> torch.Tensor:
    """q [..., |D|] -> q' [..., |T| + 1]: q on each shared token's target id, and in the last column (OUTSIDE)
    the mass of the draft tokens the target does not have."""
    draft_ids, target_ids = _target_index(mapping, q.device)
    out = torch.zeros(*q.shape[:-1], len(mapping.target_to_draft) + 1, dtype=q.dtype, device=q.device)
    out.index_add_(-1, target_ids, q[..., draft_ids])  # draft tokens with the same bytes add up
    out[..., -1] = (q.sum(dim=-1) - out[..., :-1].sum(dim=-1)).clamp(min=0.0)
    return out


def outside_id(mapping: VocabMapping) -> int:
    """The target-side id of a union draft token the target does not have."""
    return len(mapping.target_to_draft)


def union_token(draft_id: int, mapping: VocabMapping) -> int:
    target = int(mapping.draft_to_target[draft_id])
    return target if target >= 0 else outside_id(mapping)


def acceptance_rate(p: torch.Tensor, q_on_target: torch.Tensor) -> float:
    """sum_x min(p(x), q(x)) over the target's vocabulary (an OUTSIDE column, if any, adds nothing: p is 0 there)."""
    width = p.shape[-1]
    return float(torch.minimum(p, q_on_target[..., :width]).sum())
