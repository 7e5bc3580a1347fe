"""Prompt chains through PyTorch's SDPA, one row at a time over that row's own keys: bf16_attention.py's contract
(the same arguments, the same [b, T, H, d] result) for the CPUs where SDPA's flash kernel is the faster one.

Why: on an AMX CPU SDPA's flash kernel multiplies on the tiles, while bf16_attention.py's dot-product instruction
runs at half the fp32 rate there; on an avx512_bf16 CPU without AMX it is the other way round. kernel_plan.py times
both on the model's heads at its first load on a machine and keeps the faster (docs/decisions.md: "AMX").

How: a row whose prompt starts at position 0 is SDPA's own causal case; a row with cached keys (a later chunk, a
prefix-cache hit) gets the bottom-right causal mask over its keys, which SDPA's CPU flash kernel takes too. The
padding past a row's new tokens is left zero. Not row-invariant in the sense --deterministic needs (a token's
numbers depend on how its prompt was chunked), so --deterministic keeps bf16_attention.py.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
           news: torch.Tensor, scale: float) -> torch.Tensor:
    """query [b, H, T, d]; keys/values the layer's whole buffers [slots, KV, capacity, d]; slots [b] each row's cache
    row; lengths [b] its cached keys; news [b] its new tokens (a chain, already in the cache) -> [b, T, H, d]."""
    b, heads, num_new, dim = query.shape
    out = query.new_zeros(b, num_new, heads, dim)
    for row, (slot, start, new) in enumerate(zip(slots.tolist(), lengths.tolist(), news.tolist())):
        if new == 0:
            continue
        end = start + new
        mask = _chunk_mask(start, new, query.dtype) if start else None
        attended = F.scaled_dot_product_attention(
            query[row:row + 1, :, :new], keys[slot:slot + 1, :, :end], values[slot:slot + 1, :, :end],
            attn_mask=mask, is_causal=not start, scale=scale, enable_gqa=True)  # [1, H, new, d]
        out[row, :new] = attended[0].transpose(0, 1)
    return out


@lru_cache(maxsize=64)
def _chunk_mask(start: int, new: int, dtype: torch.dtype) -> torch.Tensor:
    """[new, start + new] additive, in the query's dtype: new token i sees keys 0 .. start + i (0), not the others
    (-inf). Built once for a forward's every layer; a bool mask SDPA converts at every call."""
    allowed = torch.arange(start + new)[None, :] <= start + torch.arange(new)[:, None]
    return torch.zeros(new, start + new, dtype=dtype).masked_fill(~allowed, float("-inf"))
