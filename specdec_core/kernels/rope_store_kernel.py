"""The compiled kernels of rope_store.py, at module level so numba's disk cache finds them in the next process (the
parallel one, defined inside a function and calling the serial one it closed over, got a new cache key in every
process and was compiled again each time). Imported only when first used: it imports numba."""

from numba import njit, prange

from .bf16_bits import bf16_to_f32, f32_to_bf16
from .layouts import ROPE_PARALLEL_CHUNKS as PARALLEL_CHUNKS


@njit(cache=True)
def rotate_store(q, k, v, cos, sin, rows, places, key_cache, value_cache):  # pragma: no cover
    """q [M, H, d] rotated in place; k [M, KV, d] rotated into key_cache[rows[m], :,
    places[m]]; v copied into value_cache there; cos / sin [M, d]; rows / places [M]."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, half = k.shape[1], dim // 2
    for m in range(q.shape[0]):
        r, p = rows[m], places[m]
        for h in range(heads):
            for j in range(half):
                a, b = q[m, h, j], q[m, h, j + half]
                q[m, h, j] = a * cos[m, j] + (-b) * sin[m, j]
                q[m, h, j + half] = b * cos[m, j + half] + a * sin[m, j + half]
        for h in range(kv_heads):
            for j in range(half):
                a, b = k[m, h, j], k[m, h, j + half]
                key_cache[r, h, p, j] = a * cos[m, j] + (-b) * sin[m, j]
                key_cache[r, h, p, j + half] = b * cos[m, j + half] + a * sin[m, j + half]
            for j in range(dim):
                value_cache[r, h, p, j] = v[m, h, j]

# A function of its own, not a parallel=True copy of the one above: numba's disk cache keys a function by its
# name and line, not by its options, so two variants of one function would load each other's code.
@njit(cache=True, parallel=True)
def rotate_store_parallel(q, k, v, cos, sin, rows, places, key_cache, value_cache):  # pragma: no cover
    tokens = q.shape[0]
    size = (tokens + PARALLEL_CHUNKS - 1) // PARALLEL_CHUNKS
    for chunk in prange(PARALLEL_CHUNKS):
        first = chunk * size
        last = min(tokens, first + size)
        rotate_store(q[first:last], k[first:last], v[first:last], cos[first:last], sin[first:last], rows[first:last],
                     places[first:last], key_cache, value_cache)


@njit(cache=True)
def rotate_store_bf16(q, k, v, cos, sin, rows, places, key_cache, value_cache):  # pragma: no cover
    """rotate_store for bf16 bits (uint16 arrays): each product and the sum rounded to bf16, as the eager bf16 ops
    round (x * cos, rotate_half(x) * sin, their sum), so the numbers are the eager ones bit for bit."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, half = k.shape[1], dim // 2
    for m in range(q.shape[0]):
        r, p = rows[m], places[m]
        for h in range(heads):
            for j in range(half):
                a, b = bf16_to_f32(q[m, h, j]), bf16_to_f32(q[m, h, j + half])
                q[m, h, j] = _rotated(a, -b, cos[m, j], sin[m, j])
                q[m, h, j + half] = _rotated(b, a, cos[m, j + half], sin[m, j + half])
        for h in range(kv_heads):
            for j in range(half):
                a, b = bf16_to_f32(k[m, h, j]), bf16_to_f32(k[m, h, j + half])
                key_cache[r, h, p, j] = _rotated(a, -b, cos[m, j], sin[m, j])
                key_cache[r, h, p, j + half] = _rotated(b, a, cos[m, j + half], sin[m, j + half])
            for j in range(dim):
                value_cache[r, h, p, j] = v[m, h, j]


@njit(cache=True, inline="always")
def _rotated(x, partner, cos, sin):  # pragma: no cover - compiled
    """bf16(bf16(x * cos) + bf16(partner * sin)), cos / sin bf16 bits."""
    first = bf16_to_f32(f32_to_bf16(x * bf16_to_f32(cos)))
    second = bf16_to_f32(f32_to_bf16(partner * bf16_to_f32(sin)))
    return f32_to_bf16(first + second)


@njit(cache=True, parallel=True)
def rotate_store_bf16_parallel(q, k, v, cos, sin, rows, places, key_cache, value_cache):  # pragma: no cover
    tokens = q.shape[0]
    size = (tokens + PARALLEL_CHUNKS - 1) // PARALLEL_CHUNKS
    for chunk in prange(PARALLEL_CHUNKS):
        first = chunk * size
        last = min(tokens, first + size)
        rotate_store_bf16(q[first:last], k[first:last], v[first:last], cos[first:last], sin[first:last],
                          rows[first:last], places[first:last], key_cache, value_cache)
