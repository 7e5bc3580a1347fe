"""The compiled kernel of decode_layer.py, at module level so numba's disk cache finds it again in the next process.
Imported only when first used: it imports numba and llvmlite."""

import numpy as np
from numba import njit

from .bf16_dot_kernel import matmul
from .bf16_step_attention_kernel import attend, attend_exact
from .residual_norm_kernel import add_norm_bf16, silu_mul_bf16
from .rope_store_kernel import rotate_store_bf16


@njit(cache=True)
def _project(x, panels):  # pragma: no cover - compiled
    """x uint16 [M, in] bf16 bits @ pair panels uint32 [P, in / 2, 16] -> uint16 [M, P x 16], the fp32 sums rounded
    to bf16 (bf16_dot.matmul(..., rounded=True))."""
    out = np.empty((x.shape[0], panels.shape[0] * 16), dtype=np.uint16)
    matmul(x.view(np.uint32), panels, out)
    return out


@njit(cache=True)
def layer(x, delta, weights, shape, rope, cache, attention):  # pragma: no cover - compiled
    """One layer, as FastForward._layer computes it on the bf16 kernels, for M real tokens:
    x, delta    uint16 [M, hidden] bf16 bits: the residual stream and the last MLP output still to be added
    weights     (norm1, norm2 uint16 [hidden], eps float32 [2], scale, then the qkv, o, gate_up and down pair panels
                uint32 [P, in / 2, 16], each P x 16 its out features): decode_layer.weights
    shape       (b, T, heads, key/value heads)
    rope        (cos, sin uint16 [M, d], cache rows, places int64 [M]): RoPE and where each key and value go
    cache       (keys, values): the layer's buffers, uint16 [slots, KV, capacity, d]
    attention   (flat int64 [M]: each token's place in b x T, then the step attention's slots, lengths, news,
                visible (bf16_step_attention.Step.rows) and exact: attend_exact)
    -> (x + attention's output, the MLP's output still to be added), uint16 [M, hidden] each, and the rotated
    queries uint16 [b x T, H, d] (zero padding), which a drafter may read (PLD+ (a))."""
    norm1, norm2, eps, scale, qkv, o, gate_up, down = weights
    b, num_new, heads, kv_heads = shape
    cos, sin, token_rows, places = rope
    key_cache, value_cache = cache
    flat, slots, lengths, news, visible, exact = attention
    count, hidden = x.shape
    dim = cos.shape[1]
    total, normed = np.empty((count, hidden), dtype=np.uint16), np.empty((count, hidden), dtype=np.uint16)
    add_norm_bf16(x, delta, norm1, eps[0], total, normed)
    projected = _project(normed, qkv)  # [M, (H + 2 KV) d]
    q = projected[:, :heads * dim].copy().reshape(count, heads, dim)
    k = projected[:, heads * dim:(heads + kv_heads) * dim].copy().reshape(count, kv_heads, dim)
    v = projected[:, (heads + kv_heads) * dim:(heads + 2 * kv_heads) * dim].copy().reshape(count, kv_heads, dim)
    rotate_store_bf16(q, k, v, cos, sin, token_rows, places, key_cache, value_cache)
    padded = np.zeros((b * num_new, heads, dim), dtype=np.uint16)  # the attention's [b, T] layout, zero padding
    for m in range(count):
        padded[flat[m]] = q[m]
    query = padded.reshape(b, num_new, heads, dim).view(np.uint32)  # [b, T, H, d / 2] pairs
    attended = np.empty((b, num_new, heads, dim), dtype=np.uint16)
    keys, values = key_cache.view(np.uint32), value_cache.view(np.uint32)
    if exact:
        attend_exact(query, keys, values, slots, lengths, news, visible, heads // kv_heads, scale, attended)
    else:
        attend(query, keys, values, slots, lengths, news, visible, heads // kv_heads, scale, attended)
    rows = attended.reshape(b * num_new, heads * dim)
    real = np.empty((count, heads * dim), dtype=np.uint16)
    for m in range(count):
        real[m] = rows[flat[m]]
    residual, normed = np.empty((count, hidden), dtype=np.uint16), np.empty((count, hidden), dtype=np.uint16)
    add_norm_bf16(total, _project(real, o), norm2, eps[1], residual, normed)
    both = _project(normed, gate_up)  # [M, 2I]
    gated = np.empty((count, both.shape[1] // 2), dtype=np.uint16)
    silu_mul_bf16(both, gated)
    return residual, _project(gated, down), padded
