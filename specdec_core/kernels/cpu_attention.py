"""Attention of a decode or verify step on a CPU: each row over its own keys only, read once, in a compiled loop.

A step feeds T = 1..8 new tokens per row against hundreds or thousands of cached keys, so its attention is a read of
the cache with little arithmetic. Batched matmuls over the padded `[b, kv_heads, kv_len, d]` view read every row's
keys up to the longest row's length, and run at a fraction of the memory bandwidth (their small per-head products
do not stream). This kernel runs one (row, key/value head) pair per task: it reads each of the row's real keys once
for all the query heads that share it (the group) and all T queries, then each value once.

On this project's AVX2 CPU it is faster than grouped matmuls over the padded keys (grouped_attention.py), whose
results it equals within float rounding (decisions.md: specdec_core/kernels/cpu_attention.py).

Two loops, both blocked so that several independent sums run at once (one dot product at a time is bound by each
one's reduction). A decode step (one query a row) computes the group's queries in threes against four keys at once
(twelve sums in registers), reading each key once from memory. A verify step's queries are many (group x T): the
wide loop computes two queries against four keys over chunks of keys held in the L1 cache. Both weighted sums add
four values a pass, and both softmaxes use the vectorised exp (decisions.md: "The fp32 verify attention", session
34, and "The decode attention in threes", session 35).

What each output depends on: its own query, its row's first `keys[r]` keys and values, its mask row, and how many
keys the row attends (the vectorised sums split by that count). Not on the other rows or the batch size: a (row,
head) task runs the same loops alone as in any batch.

The loops (cpu_attention_kernel.py) are compiled by numba once per machine and cached under $SPECBATCH_CACHE/numba.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads


def _compile():
    from . import cpu_attention_kernel

    return cpu_attention_kernel.attend, cpu_attention_kernel.attend_wide


kernel = LazyKernel(_compile, "compiled CPU attention", "; using batched matmuls")  # the compiled kernel, or None


def _whole(view: torch.Tensor) -> torch.Tensor:
    """A C-contiguous array for the kernel: a cache view [b, KV, L, d] cut from [b, KV, capacity, d] buffers is
    widened back to the buffer's capacity (no copy); anything else is copied. A strided array compiles to loops
    numba cannot vectorise, which run far slower."""
    view = view.detach()
    b, kv_heads, _, dim = view.shape
    stride = view.stride()
    if stride[3] == 1 and stride[2] == dim and stride[1] % dim == 0 and stride[0] == kv_heads * stride[1]:
        whole = view.as_strided((b, kv_heads, stride[1] // dim, dim), stride)
        if whole.is_contiguous():
            return whole
    return view.contiguous()


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor,
           scale: float, queries: torch.Tensor | None = None) -> torch.Tensor | None:
    """query [b, H, T, d], key/value [b, KV, L, d], keys [b] (row r attends keys 0..keys[r]-1), mask [b, 1, T, L]
    float, queries [b] (row r's first queries[r] queries are computed, the others are padding and come out zero;
    None: all T) -> [b, T, H, d] float32, or None when the kernel is unavailable. fp32 CPU tensors only.

    Why the queries: a verify step is as wide as its longest draft, and computing every row's padding made its
    attention cost the padded width (decisions.md, session 33); now it costs what the rows verify."""
    kernels = kernel()
    if kernels is None:
        return None
    b, heads, num_new, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(b, kv_heads, heads // kv_heads, num_new, dim).contiguous()  # [b, KV, G, T, d]
    key_counts, counts, flat_mask, padded = _step_arrays(keys, queries, mask, num_new)
    out = torch.zeros_like(q) if padded else torch.empty_like(q)  # padding queries: zeros
    use_torch_threads()
    run = kernels[0] if num_new == 1 else kernels[1]  # one query a row, or several (a verify step)
    run(q.numpy(), _whole(key).numpy(), _whole(value).numpy(), key_counts, counts, flat_mask, np.float32(scale),
        out.numpy())
    return out.view(b, heads, num_new, dim).transpose(1, 2)  # [b, T, H, d]


_holding = False  # inside one forward (`one_forward`): a step's arrays are converted once, for every layer
_held: tuple | None = None  # (keys, queries, mask, num_new, their arrays) of the forward's last call


@contextmanager
def one_forward():
    """Within this block every call passing the same keys, queries and mask tensors reuses their arrays: a
    forward's layers all pass the same ones, and converting them each layer was a visible share of a small batch's
    attention. Outside it, every call converts its own."""
    global _holding, _held
    _holding, _held = True, None
    try:
        yield
    finally:
        _holding, _held = False, None


def _step_arrays(keys: torch.Tensor, queries: torch.Tensor | None, mask: torch.Tensor,
                 num_new: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """The kernel's arrays of a step: keys [b] and queries [b] as int64, the mask [b, T, L] as fp32, and whether
    some row has padding queries (its output must start at zero)."""
    global _held
    held = _held
    if _holding and held is not None and held[0] is keys and held[1] is queries and held[2] is mask \
            and held[3] == num_new:
        return held[4]
    counts = np.full(keys.shape[0], num_new, dtype=np.int64) if queries is None else queries.numpy().astype(np.int64)
    arrays = (keys.numpy().astype(np.int64), counts, mask[:, 0].float().contiguous().numpy(),
              bool((counts < num_new).any()))
    if _holding:
        _held = (keys, queries, mask, num_new, arrays)
    return arrays
