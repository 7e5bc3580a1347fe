"""The compiled kernels of invariant_attention.py, at module level so numba's disk cache finds them again in the next
process (a function defined inside another, calling compiled functions it closes over, got a new cache key in every
process and was compiled again each time). Imported only when the kernel is first used: it imports numba."""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .bf16_bits import bf16_to_f32
from .fast_exp import exp_shifted, peak
from .layouts import INVARIANT_QUERY_BLOCK as QUERY_BLOCK


@njit(fastmath=True, cache=True)
def one_query(query, keys, values, seen, n, scale, scores, out):  # pragma: no cover - compiled
    """query [d]; keys, values [U, d] fp32; seen [n]: the rows of keys this query sees, in position order;
    scores [>= n] scratch -> out [d]. The only arithmetic of the kernel: the same code for every query,
    whatever else the task holds."""
    dim = query.shape[0]
    for j in range(n):
        key = keys[seen[j]]
        dot = np.float32(0.0)
        for x in range(dim):
            dot += query[x] * key[x]
        scores[j] = dot * scale
    total = exp_shifted(scores, n, peak(scores, n))  # the max is the same in any order
    out[:] = 0.0
    for j in range(n):
        value = values[seen[j]]
        weight = scores[j]
        for x in range(dim):
            out[x] += weight * value[x]
    for x in range(dim):
        out[x] = out[x] / total


def widen(row, target):
    """target[:] = a key or value row as fp32: fp32 copied, bf16 bits (uint16) widened exactly (bf16_bits.py). The
    overload below compiles one of the two per cache dtype."""
    target[:] = row if row.dtype == np.float32 else (row.astype(np.uint32) << np.uint32(16)).view(np.float32)


@overload(widen)
def _widen(row, target):
    if isinstance(row.dtype, types.Float):
        def copy(row, target):
            for x in range(row.shape[0]):
                target[x] = row[x]
        return copy

    def from_bf16(row, target):
        for x in range(row.shape[0]):
            target[x] = bf16_to_f32(row[x])
    return from_bf16


@njit(cache=True)
def gather(source, slot, h, positions, count, dest):  # pragma: no cover - compiled
    """dest[u] = source[slot, h, positions[u]] as fp32 for u < count."""
    for u in range(count):
        widen(source[slot, h, positions[u]], dest[u])


@njit(parallel=True, cache=True)
def attend(q, k, v, slots, lengths, visible, scale, out):  # pragma: no cover - compiled
    """q [b, KV, G, T, d] fp32; k, v [slots, KV, capacity, d] fp32 or uint16 (bf16 bits); slots [b] cache row
    of each batch row; lengths [b] cached keys; visible [b, T, T] uint8 (new token t may see new token i);
    out [b, KV, G, T, d] fp32 (padding tokens, which see nothing, get zeros)."""
    rows, kv_heads, group, num_new, dim = q.shape
    blocks = (num_new + QUERY_BLOCK - 1) // QUERY_BLOCK
    for task in prange(rows * kv_heads * blocks):
        r = task // (kv_heads * blocks)
        h = (task // blocks) % kv_heads
        first = (task % blocks) * QUERY_BLOCK
        last = min(num_new, first + QUERY_BLOCK)
        slot, length = slots[r], lengths[r]
        # the block's keys: the cached ones, then every new token some query of the block sees, in order
        used = np.zeros(num_new, dtype=np.uint8)
        for t in range(first, last):
            if visible[r, t, t] != 0:
                for i in range(num_new):
                    used[i] |= visible[r, t, i]
        positions = np.empty(length + num_new, dtype=np.int64)
        where = np.empty(num_new, dtype=np.int64)  # new token i's row in the block's keys
        count = 0
        for j in range(length):
            positions[count] = j
            count += 1
        for i in range(num_new):
            if used[i] != 0:
                where[i] = count
                positions[count] = length + i
                count += 1
        keys = np.empty((count, dim), dtype=np.float32)
        values = np.empty((count, dim), dtype=np.float32)
        gather(k, slot, h, positions, count, keys)
        gather(v, slot, h, positions, count, values)
        seen = np.empty(count, dtype=np.int64)
        scores = np.empty(count, dtype=np.float32)
        for t in range(first, last):
            if visible[r, t, t] == 0:
                for g in range(group):
                    out[r, h, g, t, :] = 0.0
                continue
            n = 0  # this token's keys, in position order: the same list as when it is fed alone
            for j in range(length):
                seen[n] = j
                n += 1
            for i in range(num_new):
                if visible[r, t, i] != 0:
                    seen[n] = where[i]
                    n += 1
            for g in range(group):
                one_query(q[r, h, g, t], keys, values, seen, n, scale, scores, out[r, h, g, t])

