"""Attention for the batched loop's short forwards on a CPU: grouped-query attention as two matmuls per key/value head.

A decode or verify step feeds T = 1..9 new tokens per row against hundreds of cached keys, so its attention reads
the cache and does little arithmetic. PyTorch's CPU SDPA kernel (flash attention for CPU) is built for long queries:
it splits work by query block and reads each key/value head once per query head, and it copies a non-contiguous
cache view first. On this project's AVX2 CPU this function was faster at each T tried, most at the smallest; over a
whole model that is a visible share of a plain step and more of a verify step, which is where speculation's extra
tokens are paid for (decisions.md: specdec_core/model/grouped_attention.py).

How: the query heads that share a key/value head are stacked as extra query rows, so one matmul per (row, kv head)
reads each cached key once: q [b, kv, group x T, d] @ k^T [b, kv, d, L] -> scores, + the mask, softmax in fp32,
@ v [b, kv, L, d]. Long queries (prefill), GPUs, boolean or absent masks and anything unusual go to the model's SDPA
path unchanged, so `generate` and prefill are untouched; so do bf16 and fp16 forwards, whose scores SDPA
accumulates in fp32. The result is the same attention (equal to SDPA within float
rounding; the batched loop's lossless tests compare whole outputs with `ar` and HF greedy).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..kernels import cpu_attention

NAME = "specbatch_grouped"
MAX_QUERIES = 8  # tokens a row above which SDPA is as fast (decisions.md: specdec_core/model/grouped_attention.py)
MAX_SCORE_BYTES = 256 << 20  # scores [b, heads, T, L] beyond this go to SDPA, which never materialises them
# Key values (keys over all rows x kv_heads x head_dim) from which a forward's attention runs the compiled kernel.
# Below it, the kernel's fixed cost per layer (its parallel region, the copies into numpy views) is more than it
# saves. Counted in values, not keys, so a model with small heads crosses it as late as its work warrants
# (decisions.md: specdec_core/model/grouped_attention.py).
KERNEL_MIN_KEY_VALUES = 64 * 3 * 64
_row_keys: torch.Tensor | None = None  # [b] keys each row attends in the running forward (real_keys)
_most_keys = 0  # their maximum, read once per forward rather than once per layer
_row_queries: torch.Tensor | None = None  # [b] each row's new tokens up to its last real one (None: all T)


@contextmanager
def real_keys(counts: torch.Tensor, values_per_key: int, queries: torch.Tensor | None = None):
    """Within this block, row r of a forward attends its first counts[r] keys only (its cached tokens and the
    step's new ones; the rest of the padded view is other rows' length): the compiled kernel (cpu_attention.py)
    reads just those, when there are enough of them (values_per_key = kv_heads x head_dim). queries [b]: row r's
    queries past queries[r] are padding, which the kernel does not compute (None: every query is computed)."""
    global _row_keys, _most_keys, _row_queries
    before = _row_keys, _most_keys, _row_queries
    _row_keys = counts if int(counts.sum()) * values_per_key >= KERNEL_MIN_KEY_VALUES else None
    _most_keys = int(counts.max()) if _row_keys is not None else 0
    _row_queries = queries if _row_keys is not None else None
    try:
        with cpu_attention.one_forward():
            yield
    finally:
        _row_keys, _most_keys, _row_queries = before


def grouped_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """query [b, H, T, d], key/value [b, KV, L, d], attention_mask [b, 1, T, L] float (0 or dtype-min)
    -> ([b, T, H, d], None), as transformers' attention functions return."""
    b, heads, num_new, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    usable = (
        query.device.type == "cpu"
        and query.dtype == torch.float32  # bf16/fp16 scores would be rounded (or overflow) before the softmax
        and num_new <= MAX_QUERIES
        and attention_mask is not None
        and attention_mask.is_floating_point()
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and not dropout
        and all(kwargs.get(name) is None for name in ("softcap", "position_bias", "is_causal", "cache", "s_aux"))
        and heads % kv_heads == 0
        and value.shape[-1] == dim
        and b * heads * num_new * kv_len * 4 <= MAX_SCORE_BYTES
    )
    if not usable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else dim ** -0.5
    if _row_keys is not None and _row_keys.shape[0] == b and _most_keys <= kv_len:
        queries = _row_queries if _row_queries is not None and _row_queries.shape[0] == b else None
        out = cpu_attention.attend(query, key, value, _row_keys, attention_mask, scale, queries)
        if out is not None:
            return out.contiguous(), None
    group = heads // kv_heads
    # Query head h uses key/value head h // group (as repeat_kv and SDPA's enable_gqa).
    stacked = query.reshape(b, kv_heads, group * num_new, dim)  # [b, KV, group x T, d]
    scores = torch.matmul(stacked, key.transpose(-1, -2))  # [b, KV, group x T, L]
    scores = scores.view(b, kv_heads, group, num_new, kv_len).float() * scale
    scores = scores + attention_mask[:, :, None].float()  # mask [b, 1, 1, T, L]: the same for every head
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(b, kv_heads, group * num_new, kv_len)
    out = torch.matmul(probs, value)  # [b, KV, group x T, d]
    return out.view(b, heads, num_new, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # masks the model builds itself are SDPA's
