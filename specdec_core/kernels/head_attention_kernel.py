"""The kernel of head_attention.py, at module level so numba's disk cache finds it in the next process. Imported only
when first used: it imports numba and llvmlite."""

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .bf16_bits import bf16_to_f32


def as_f32(value):  # pragma: no cover - replaced by its overload inside compiled code
    raise NotImplementedError


@overload(as_f32, inline="always")
def _as_f32(value):
    if value == types.uint16:  # bf16 bits
        return lambda value: bf16_to_f32(value)
    if value == types.float32:
        return lambda value: value
    return None


# fastmath: the dot products vectorise; these weights only choose which copy a drafter proposes.
@njit(cache=True, parallel=True, fastmath=True)
def most_attention(keys, rows, lengths, starts, queries, kv_of_head, wanted, scale, out):  # pragma: no cover
    """One layer's heads, for R rows at once.

    keys [slots, KV, capacity, d] the layer's key cache (float32, or bf16 bits as uint16); rows [R] cache rows;
    lengths [R] keys each row attends (0..length-1); starts [R] its first visible key (a sliding window);
    queries [R, n, d] float32 post-rotary queries of the layer's n heads; kv_of_head [n] each head's key head;
    wanted [R, n] which heads each row reads; scale the attention's scaling;
    out [R, >= max(lengths)] float32: raised to each wanted head's softmax weight where that is larger, in place.
    """
    count, heads, dim = queries.shape
    for r in prange(count):
        row, length, start = rows[r], lengths[r], starts[r]
        scores = np.empty((heads, max(length - start, 0)), dtype=np.float32)
        for j in range(start, length):  # each key row read once, for every head of the layer
            for h in range(heads):
                if wanted[r, h]:
                    kv = kv_of_head[h]
                    total = np.float32(0.0)
                    for t in range(dim):
                        total += queries[r, h, t] * as_f32(keys[row, kv, j, t])
                    scores[h, j - start] = total * scale
        for h in range(heads):
            if not wanted[r, h] or length <= start:
                continue
            peak = scores[h, 0]
            for j in range(1, length - start):
                peak = max(peak, scores[h, j])
            norm = np.float32(0.0)
            for j in range(length - start):
                weight = np.float32(math.exp(scores[h, j] - peak))
                scores[h, j] = weight
                norm += weight
            for j in range(length - start):
                out[r, start + j] = max(out[r, start + j], scores[h, j] / norm)
