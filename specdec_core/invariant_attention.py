"""Attention whose result for a token depends only on that token's query and the keys it may see: not on how many
tokens its row feeds in the forward (1 for `ar`, k + 1 for a verify, a tree's nodes, a prefill chunk), not on the
other rows, their lengths or the batch size. With it, a lossless method's tokens equal `ar`'s bit for bit in bf16
too, as they do in fp32 (issue 33; `--deterministic`).

What guarantees it: each (row, key/value head, query token) is one task that
1. lists the keys its token sees, in position order: the row's cached keys 0..length-1, then the new tokens it may
   attend (a chain: those before it and itself; a tree node: its ancestors and itself), so the list is the same
   as when that token is fed alone at its position (a tree's ancestors sit at node slots, in depth order);
2. computes every score as an fp32 dot product over head_dim in one fixed loop, the softmax in fp32 over exactly
   that list (max, then exp and sum in list order), and the weighted sum of values in list order;
3. runs the same compiled code for every query count, batch and row.
Only the list's length and contents enter the arithmetic, and for one token they are the same in every forward.
The keys and values are read from the cache's buffers directly: fp32, or bf16 widened exactly to fp32.

Compiled by numba once per machine (cached under $SPECBATCH_CACHE/numba).
"""

from __future__ import annotations

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads


def _compile():
    # One function: numba compiles the kernel with the bf16 widening it inlines, both defined here so that importing
    # this module never imports numba (the kernel's own loop is one task's attention, not split further on purpose).
    from numba import njit, prange, types
    from numba.extending import overload

    def widen(row, bits, floats):
        """A key or value row as fp32: fp32 as is, bf16 bits (uint16) widened exactly. This numpy form is what the
        overload below compiles, per dtype, inside the kernel."""
        if row.dtype == np.float32:
            return row
        bits[:] = row.astype(np.uint32) << np.uint32(16)
        return floats

    @overload(widen)
    def _widen(row, bits, floats):
        if isinstance(row.dtype, types.Float):
            return lambda row, bits, floats: row  # fp32 keys: read in place

        def from_bf16(row, bits, floats):  # bf16 bits (as uint16) -> the same numbers in fp32, exactly
            for x in range(row.shape[0]):
                bits[x] = np.uint32(row[x]) << np.uint32(16)
            return floats

        return from_bf16

    @njit(parallel=True, fastmath=True, cache=True)
    def attend(q, k, v, slots, lengths, visible, scale, out):  # pragma: no cover - compiled
        """q [b, KV, G, T, d] fp32; k, v [slots, KV, capacity, d] fp32 or uint16 (bf16 bits); slots [b] cache row
        of each batch row; lengths [b] cached keys; visible [b, T, T] uint8 (new token t may see new token i);
        out [b, KV, G, T, d] fp32 (padding tokens, which see nothing, get zeros)."""
        rows, kv_heads, group, num_new, dim = q.shape
        for task in prange(rows * kv_heads * num_new):
            r = task // (kv_heads * num_new)
            h = (task // num_new) % kv_heads
            t = task % num_new
            if visible[r, t, t] == 0:
                for g in range(group):
                    out[r, h, g, t, :] = 0.0
                continue
            slot, length = slots[r], lengths[r]
            seen = np.empty(length + num_new, dtype=np.int64)  # the keys this token sees, in position order
            n = 0
            for j in range(length):
                seen[n] = j
                n += 1
            for i in range(num_new):
                if visible[r, t, i] != 0:
                    seen[n] = length + i
                    n += 1
            bits = np.empty(dim, dtype=np.uint32)
            floats = bits.view(np.float32)
            scores = np.empty(n, dtype=np.float32)
            acc = np.empty(dim, dtype=np.float32)
            for g in range(group):
                query = q[r, h, g, t]
                for j in range(n):
                    key = widen(k[slot, h, seen[j]], bits, floats)
                    dot = np.float32(0.0)
                    for x in range(dim):
                        dot += query[x] * key[x]
                    scores[j] = dot * scale
                peak = scores[0]
                for j in range(1, n):
                    peak = max(peak, scores[j])
                total = np.float32(0.0)
                for j in range(n):
                    scores[j] = np.exp(scores[j] - peak)
                    total += scores[j]
                acc[:] = 0.0
                for j in range(n):
                    value = widen(v[slot, h, seen[j]], bits, floats)
                    weight = scores[j]
                    for x in range(dim):
                        acc[x] += weight * value[x]
                for x in range(dim):
                    out[r, h, g, t, x] = acc[x] / total

    return attend


kernel = LazyKernel(_compile, "invariant CPU attention", "")  # the compiled kernel, or None


def _as_array(buffer: torch.Tensor) -> np.ndarray:
    """A cache buffer [slots, KV, capacity, d] for the kernel, without a copy: fp32 as is, bf16 as its uint16 bits."""
    if buffer.dtype == torch.bfloat16:
        return buffer.view(torch.int16).numpy().view(np.uint16)
    if buffer.dtype != torch.float32:
        raise TypeError(f"invariant attention reads fp32 or bf16 caches, not {buffer.dtype}")
    return buffer.numpy()


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
           visible: torch.Tensor, scale: float) -> torch.Tensor:
    """query [b, H, T, d] (any float dtype); keys/values the layer's whole buffers [slots, KV, capacity, d];
    slots [b] each batch row's cache row; lengths [b] its cached keys; visible [b, T, T] bool
    -> [b, T, H, d] in the query's dtype."""
    run = kernel()
    if run is None:
        raise RuntimeError(f"the deterministic attention needs numba: {kernel.unavailable}")
    b, heads, num_new, dim = query.shape
    kv_heads = keys.shape[1]
    q = query.float().reshape(b, kv_heads, heads // kv_heads, num_new, dim).contiguous()  # [b, KV, G, T, d]
    out = torch.empty_like(q)
    use_torch_threads()
    run(q.numpy(), _as_array(keys), _as_array(values), slots.numpy().astype(np.int64),
        lengths.numpy().astype(np.int64), visible.numpy().astype(np.uint8), np.float32(scale), out.numpy())
    return out.view(b, heads, num_new, dim).transpose(1, 2).to(query.dtype)  # [b, T, H, d]
