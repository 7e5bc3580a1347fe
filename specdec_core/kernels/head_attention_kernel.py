"""The kernel of head_attention.py, at module level so numba's disk cache finds it in the next process. Imported only
when first used: it imports numba and llvmlite."""

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .bf16_bits import bf16_to_f32


def as_f32(value):
    """A key element as float32: bf16 bits (uint16) widened exactly, float32 as it is. Compiled code uses the
    overload below."""
    if isinstance(value, np.uint16):
        return np.array([int(value) << 16], dtype=np.uint32).view(np.float32)[0]
    return np.float32(value)


@overload(as_f32, inline="always")
def _as_f32(value):
    if value == types.uint16:  # bf16 bits
        return lambda value: bf16_to_f32(value)
    if value == types.float32:
        return lambda value: value
    return None


# fastmath: the dot products vectorise; these weights only choose which copy a drafter proposes.
@njit(cache=True, parallel=True, fastmath=True)
def most_attention(keys, rows, lengths, starts, queries, kv_of_head, wanted, scales, out):  # pragma: no cover
    """Y layers' heads, for R rows at once.

    keys: a tuple of Y key caches [slots, KV, capacity, d] (float32, or bf16 bits as uint16); rows [R] cache rows;
    lengths [R] keys each row attends (0..length-1); starts [Y, R] its first visible key in each layer (a sliding
    window); queries [Y, R, n, d] float32 post-rotary queries; kv_of_head [Y, n] each head's key head; wanted
    [Y, R, n] which heads a row reads; scales [Y] the attentions' scaling;
    out [R, >= max(lengths)] float32: raised to each wanted head's softmax weight where that is larger, in place.
    """
    layers, count, heads, dim = queries.shape
    for r in prange(count):
        row, length = rows[r], lengths[r]
        for y in range(layers):
            layer_keys = keys[y]
            start = starts[y, r]
            span = max(length - start, 0)
            scores = np.empty((heads, span), dtype=np.float32)
            for j in range(start, length):  # each key row read once, for every head of the layer
                for h in range(heads):
                    if wanted[y, r, h]:
                        kv = kv_of_head[y, h]
                        total = np.float32(0.0)
                        for t in range(dim):
                            total += queries[y, r, h, t] * as_f32(layer_keys[row, kv, j, t])
                        scores[h, j - start] = total * scales[y]
            for h in range(heads):
                if not wanted[y, r, h] or span == 0:
                    continue
                peak = scores[h, 0]
                for j in range(1, span):
                    peak = max(peak, scores[h, j])
                norm = np.float32(0.0)
                for j in range(span):
                    weight = np.float32(math.exp(scores[h, j] - peak))
                    scores[h, j] = weight
                    norm += weight
                for j in range(span):
                    out[r, start + j] = max(out[r, start + j], scores[h, j] / norm)
