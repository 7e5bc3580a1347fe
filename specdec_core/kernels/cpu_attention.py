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

Compiled by numba once per machine and cached under $SPECBATCH_CACHE/numba.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads


def _compile():
    from numba import njit, prange

    from .fast_exp import exp_nonpositive

    @njit(parallel=True, fastmath=True, cache=True)
    def attend(q, k, v, keys, queries, mask, scale, out):  # pragma: no cover - compiled
        """q [b, KV, G, 1, d]; k, v [b, KV, >= max(keys), d]; keys [b]; queries [b] (0: a padding row, its output left
        as it is; else 1); mask [b, 1, >= max(keys)]; out [b, KV, G, 1, d]. The group's queries in threes (the rest one
        at a time) against four keys at once."""
        rows, kv_heads, group, _, dim = q.shape
        threes = group // 3 * 3
        for task in prange(rows * kv_heads):
            r, h = task // kv_heads, task % kv_heads
            n = keys[r]
            if queries[r] == 0:
                continue
            fours = n // 4 * 4
            scores = np.empty((group, n), dtype=np.float32)
            for m in range(0, threes, 3):
                for key in range(0, fours, 4):
                    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = np.float32(0.0)
                    for x in range(dim):
                        k0, k1 = k[r, h, key, x], k[r, h, key + 1, x]
                        k2, k3 = k[r, h, key + 2, x], k[r, h, key + 3, x]
                        qa, qb, qc = q[r, h, m, 0, x], q[r, h, m + 1, 0, x], q[r, h, m + 2, 0, x]
                        a0 += qa * k0
                        a1 += qa * k1
                        a2 += qa * k2
                        a3 += qa * k3
                        b0 += qb * k0
                        b1 += qb * k1
                        b2 += qb * k2
                        b3 += qb * k3
                        c0 += qc * k0
                        c1 += qc * k1
                        c2 += qc * k2
                        c3 += qc * k3
                    scores[m, key], scores[m, key + 1], scores[m, key + 2], scores[m, key + 3] = a0, a1, a2, a3
                    scores[m + 1, key], scores[m + 1, key + 1] = b0, b1
                    scores[m + 1, key + 2], scores[m + 1, key + 3] = b2, b3
                    scores[m + 2, key], scores[m + 2, key + 1] = c0, c1
                    scores[m + 2, key + 2], scores[m + 2, key + 3] = c2, c3
                for key in range(fours, n):
                    a0 = b0 = c0 = np.float32(0.0)
                    for x in range(dim):
                        a0 += q[r, h, m, 0, x] * k[r, h, key, x]
                        b0 += q[r, h, m + 1, 0, x] * k[r, h, key, x]
                        c0 += q[r, h, m + 2, 0, x] * k[r, h, key, x]
                    scores[m, key], scores[m + 1, key], scores[m + 2, key] = a0, b0, c0
            for m in range(threes, group):
                for key in range(n):
                    a0 = np.float32(0.0)
                    for x in range(dim):
                        a0 += q[r, h, m, 0, x] * k[r, h, key, x]
                    scores[m, key] = a0
            for m in range(group):  # scale, mask and softmax in place
                for key in range(n):
                    scores[m, key] = scores[m, key] * scale + mask[r, 0, key]
                peak = scores[m, 0]
                for key in range(1, n):
                    peak = max(peak, scores[m, key])
                total = np.float32(0.0)
                for key in range(n):
                    weight = exp_nonpositive(scores[m, key] - peak)
                    scores[m, key] = weight
                    total += weight
                inverse = np.float32(1.0) / total
                for key in range(n):
                    scores[m, key] *= inverse
            acc = np.zeros((group, dim), dtype=np.float32)
            for m in range(0, threes, 3):
                for key in range(0, fours, 4):
                    w0, w1, w2, w3 = scores[m, key], scores[m, key + 1], scores[m, key + 2], scores[m, key + 3]
                    u0, u1 = scores[m + 1, key], scores[m + 1, key + 1]
                    u2, u3 = scores[m + 1, key + 2], scores[m + 1, key + 3]
                    s0, s1 = scores[m + 2, key], scores[m + 2, key + 1]
                    s2, s3 = scores[m + 2, key + 2], scores[m + 2, key + 3]
                    for x in range(dim):
                        v0, v1 = v[r, h, key, x], v[r, h, key + 1, x]
                        v2, v3 = v[r, h, key + 2, x], v[r, h, key + 3, x]
                        acc[m, x] += (w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3)
                        acc[m + 1, x] += (u0 * v0 + u1 * v1) + (u2 * v2 + u3 * v3)
                        acc[m + 2, x] += (s0 * v0 + s1 * v1) + (s2 * v2 + s3 * v3)
            for m in range(threes, group):
                for key in range(0, fours, 4):
                    w0, w1, w2, w3 = scores[m, key], scores[m, key + 1], scores[m, key + 2], scores[m, key + 3]
                    for x in range(dim):
                        v0, v1 = v[r, h, key, x], v[r, h, key + 1, x]
                        v2, v3 = v[r, h, key + 2, x], v[r, h, key + 3, x]
                        acc[m, x] += (w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3)
            for m in range(group):
                for key in range(fours, n):
                    w0 = scores[m, key]
                    for x in range(dim):
                        acc[m, x] += w0 * v[r, h, key, x]
                for x in range(dim):
                    out[r, h, m, 0, x] = acc[m, x]

    @njit(parallel=True, fastmath=True, cache=True)
    def attend_wide(q, k, v, keys, queries, mask, scale, out):  # pragma: no cover - compiled
        """q [b, KV, G, T, d]; k, v [b, KV, >= max(keys), d]; keys [b]; queries [b] <= T: the queries of row r
        computed (the rest are padding: their outputs are left as they are); mask [b, T, >= max(keys)] (added to the
        scaled scores: 0 or a large negative); out [b, KV, G, T, d]. Queries in pairs (an odd count gets a zero
        query, computed and dropped), keys in fours, over CHUNK keys at a time."""
        rows, kv_heads, group, _, dim = q.shape
        for task in prange(rows * kv_heads):
            r, h = task // kv_heads, task % kv_heads
            n, num_new = keys[r], queries[r]
            real = group * num_new
            paired = real + (real & 1)
            qm = np.zeros((paired, dim), dtype=np.float32)  # [group x T (+1), d]: query m = g x T + t
            for g in range(group):
                for t in range(num_new):
                    for x in range(dim):
                        qm[g * num_new + t, x] = q[r, h, g, t, x]
            scores = np.zeros((paired, n), dtype=np.float32)
            for c0 in range(0, n, CHUNK):
                c1 = min(n, c0 + CHUNK)
                fours = c0 + (c1 - c0) // 4 * 4
                for m in range(0, paired, 2):
                    for key in range(c0, fours, 4):
                        a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                        for x in range(dim):
                            qa, qb = qm[m, x], qm[m + 1, x]
                            k0, k1 = k[r, h, key, x], k[r, h, key + 1, x]
                            k2, k3 = k[r, h, key + 2, x], k[r, h, key + 3, x]
                            a0 += qa * k0
                            a1 += qa * k1
                            a2 += qa * k2
                            a3 += qa * k3
                            b0 += qb * k0
                            b1 += qb * k1
                            b2 += qb * k2
                            b3 += qb * k3
                        scores[m, key], scores[m, key + 1], scores[m, key + 2], scores[m, key + 3] = a0, a1, a2, a3
                        scores[m + 1, key], scores[m + 1, key + 1] = b0, b1
                        scores[m + 1, key + 2], scores[m + 1, key + 3] = b2, b3
                    for key in range(fours, c1):
                        a0 = b0 = np.float32(0.0)
                        for x in range(dim):
                            a0 += qm[m, x] * k[r, h, key, x]
                            b0 += qm[m + 1, x] * k[r, h, key, x]
                        scores[m, key], scores[m + 1, key] = a0, b0
            for m in range(real):  # scale, mask and softmax in place (a zero query's row is never written out)
                t = m % num_new
                for key in range(n):
                    scores[m, key] = scores[m, key] * scale + mask[r, t, key]
                peak = scores[m, 0]
                for key in range(1, n):
                    peak = max(peak, scores[m, key])
                total = np.float32(0.0)
                for key in range(n):
                    weight = exp_nonpositive(scores[m, key] - peak)
                    scores[m, key] = weight
                    total += weight
                inverse = np.float32(1.0) / total
                for key in range(n):
                    scores[m, key] *= inverse
            acc = np.zeros((paired, dim), dtype=np.float32)
            for c0 in range(0, n, CHUNK):
                c1 = min(n, c0 + CHUNK)
                fours = c0 + (c1 - c0) // 4 * 4
                for m in range(0, paired, 2):
                    for key in range(c0, fours, 4):
                        w0, w1, w2, w3 = scores[m, key], scores[m, key + 1], scores[m, key + 2], scores[m, key + 3]
                        u0, u1 = scores[m + 1, key], scores[m + 1, key + 1]
                        u2, u3 = scores[m + 1, key + 2], scores[m + 1, key + 3]
                        for x in range(dim):
                            v0, v1 = v[r, h, key, x], v[r, h, key + 1, x]
                            v2, v3 = v[r, h, key + 2, x], v[r, h, key + 3, x]
                            acc[m, x] += (w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3)
                            acc[m + 1, x] += (u0 * v0 + u1 * v1) + (u2 * v2 + u3 * v3)
                    for key in range(fours, c1):
                        w0, u0 = scores[m, key], scores[m + 1, key]
                        for x in range(dim):
                            acc[m, x] += w0 * v[r, h, key, x]
                            acc[m + 1, x] += u0 * v[r, h, key, x]
            for g in range(group):
                for t in range(num_new):
                    for x in range(dim):
                        out[r, h, g, t, x] = acc[g * num_new + t, x]

    return attend, attend_wide


CHUNK = 64  # keys a chunk of the wide loop: 16 KB of fp32 keys (d = 64), reread from L1 by every query pair
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
