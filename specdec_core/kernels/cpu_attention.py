"""Attention of a decode or verify step on a CPU: each row over its own keys only, read once, in a compiled loop.

A step feeds T = 1..8 new tokens per row against hundreds or thousands of cached keys, so its attention is a read of
the cache with little arithmetic. Batched matmuls over the padded `[b, kv_heads, kv_len, d]` view read every row's
keys up to the longest row's length, and run at a fraction of the memory bandwidth (their small per-head products
do not stream). This kernel runs one (row, key/value head) pair per task: it reads each of the row's real keys once
for all the query heads that share it (the group) and all T queries, then each value once.

On this project's AVX2 CPU it is faster than grouped matmuls over the padded keys (grouped_attention.py), whose
results it equals within float rounding (decisions.md: specdec_core/kernels/cpu_attention.py).

What each output depends on: its own query, its row's first `keys[r]` keys and values, its mask row, and how many
keys the row attends (the vectorised sums split by that count). Not on the other rows or the batch size: a (row,
head) task runs the same loops alone as in any batch.

Compiled by numba once per machine and cached under $SPECBATCH_CACHE/numba.
"""

from __future__ import annotations

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads


def _compile():
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=True)
    def attend(q, k, v, keys, queries, mask, scale, out):  # pragma: no cover - compiled
        """q [b, KV, G, T, d]; k, v [b, KV, >= max(keys), d]; keys [b]; queries [b] <= T: the queries of row r
        computed (the rest are padding: their outputs are left as they are); mask [b, T, >= max(keys)] (added to the
        scaled scores: 0 or a large negative); out [b, KV, G, T, d]."""
        rows, kv_heads, group, _, dim = q.shape
        for task in prange(rows * kv_heads):
            r, h = task // kv_heads, task % kv_heads
            n, num_new = keys[r], queries[r]
            scores = np.empty((group * num_new, n), dtype=np.float32)
            for key in range(n):
                k_row = k[r, h, key]
                for g in range(group):
                    for t in range(num_new):
                        q_row = q[r, h, g, t]
                        dot = np.float32(0.0)
                        for x in range(dim):
                            dot += q_row[x] * k_row[x]
                        scores[g * num_new + t, key] = dot * scale + mask[r, t, key]
            for query in range(group * num_new):  # softmax in place
                peak = scores[query, 0]
                for key in range(1, n):
                    peak = max(peak, scores[query, key])
                total = np.float32(0.0)
                for key in range(n):
                    weight = np.exp(scores[query, key] - peak)
                    scores[query, key] = weight
                    total += weight
                for key in range(n):
                    scores[query, key] /= total
            acc = np.zeros((group * num_new, dim), dtype=np.float32)
            for key in range(n):
                v_row = v[r, h, key]
                for query in range(group * num_new):
                    weight = scores[query, key]
                    for x in range(dim):
                        acc[query, x] += weight * v_row[x]
            for g in range(group):
                for t in range(num_new):
                    out[r, h, g, t] = acc[g * num_new + t]

    return attend


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
    run = kernel()
    if run is None:
        return None
    b, heads, num_new, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(b, kv_heads, heads // kv_heads, num_new, dim).contiguous()  # [b, KV, G, T, d]
    counts = np.full(b, num_new, dtype=np.int64) if queries is None else queries.numpy().astype(np.int64)
    out = torch.empty_like(q) if queries is None else torch.zeros_like(q)  # padding queries: zeros
    use_torch_threads()
    run(q.numpy(), _whole(key).numpy(), _whole(value).numpy(), keys.numpy().astype(np.int64), counts,
        mask[:, 0].float().contiguous().numpy(), np.float32(scale), out.numpy())
    return out.view(b, heads, num_new, dim).transpose(1, 2)  # [b, T, H, d]
