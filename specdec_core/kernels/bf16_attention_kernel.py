"""The compiled kernel of bf16_attention.py, at module level so numba's disk cache finds it again in the next
process. Imported only when the kernel is first used: it imports numba and llvmlite."""

import numpy as np
from numba import njit, prange

from .layouts import BF16_ATTENTION_QUERY_BLOCK as QUERY_BLOCK, DOT_PANEL as PANEL, DOT_ROWS as ROWS, DOT_WIDTH as WIDTH
from .bf16_dot_kernel import held_rows, rest_rows
from .bf16_bits import f32_to_bf16
from .fast_exp import exp_shifted, peak


@njit(cache=True)
def product(x, panels, out, rows, count):  # pragma: no cover - compiled
    """out[:rows, :count x 16] = x[:rows] @ panels[:count] through vdpbf16ps (bf16_dot_kernel.py); x uint32
    [>= rows, K2] bf16 pairs, panels uint32 [>= count, K2, 16], count a multiple of WIDTH."""
    held = rows // ROWS * ROWS
    for p in range(0, count, WIDTH):
        for m in range(0, held, ROWS):
            held_rows(x, m, panels, p, out)
        if held < rows:
            rest_rows(x, held, rows - held, panels, p, out)


@njit(cache=True)
def key_panels(keys, n, panels):  # pragma: no cover - compiled
    """keys uint16 [>= n, d] -> panels uint32 [>= ceil(n / 32) x 2, d / 2, 16], the right-hand side of q @ k^T:
    panel p, pair c, lane l holds dimensions 2c, 2c + 1 of key 16p + l; the lanes past n up to a multiple of 32
    keys are zeros."""
    half = panels.shape[1]
    for key in range(n):
        row = keys[key]
        p, lane = key // PANEL, key % PANEL
        for c in range(half):
            panels[p, c, lane] = np.uint32(row[2 * c]) | (np.uint32(row[2 * c + 1]) << np.uint32(16))
    for key in range(n, (n + WIDTH * PANEL - 1) // (WIDTH * PANEL) * (WIDTH * PANEL)):
        for c in range(half):
            panels[key // PANEL, c, key % PANEL] = 0


@njit(cache=True)
def value_panels(values, n, panels):  # pragma: no cover - compiled
    """values uint16 [>= n, d] -> panels uint32 [>= d / 16, >= ceil(n / 32) x 16, 16], the right-hand side of
    p @ v: panel p, pair c, lane l holds dimension 16p + l of values 2c and 2c + 1; a missing value 2c + 1, the pairs
    past n up to a multiple of 32 values and the dimensions past d are zeros."""
    dim = values.shape[1]
    columns, depth = panels.shape[0], (n + WIDTH * PANEL - 1) // (WIDTH * PANEL) * (WIDTH * PANEL) // 2
    for c in range(depth):
        for x in range(columns * PANEL):
            low = values[2 * c, x] if x < dim and 2 * c < n else 0
            high = values[2 * c + 1, x] if x < dim and 2 * c + 1 < n else 0
            panels[x // PANEL, c, x % PANEL] = np.uint32(low) | (np.uint32(high) << np.uint32(16))


@njit(fastmath=True, cache=True)
def softmax_to_bf16(scores, seen, width, scale, weights):  # pragma: no cover - compiled
    """scores [>= seen] raw q.k of one query -> weights [width] uint16: exp(scale x score - max) rounded to bf16
    (nearest even) for the first `seen`, zeros after; -> their fp32 sum before rounding."""
    for j in range(seen):
        scores[j] = scores[j] * scale
    total = exp_shifted(scores, seen, peak(scores, seen))
    for j in range(seen):
        weights[j] = f32_to_bf16(scores[j])
    for j in range(seen, width):
        weights[j] = 0
    return total


@njit(parallel=True, cache=True)
def attend(q, k, v, slots, lengths, news, scale, out):  # pragma: no cover - compiled
    """q uint32 [b, T, H, d / 2] (bf16 pairs); k, v uint16 [slots, KV, capacity, d] (bf16 bits); slots, lengths,
    news int64 [b]: each row's cache row, cached keys and new tokens; out uint16 [b, T, H, d] (bf16 bits, rounded to
    nearest even as torch rounds). New token t < news[r]
    of row r sees keys 0 .. lengths[r] + t; the padding tokens after news[r] get zeros."""
    b, num_new, heads, half = q.shape
    kv_heads, dim = k.shape[1], k.shape[3]
    group = heads // kv_heads
    blocks = (num_new + QUERY_BLOCK - 1) // QUERY_BLOCK
    pairs = b * kv_heads
    columns = (dim + WIDTH * PANEL - 1) // (WIDTH * PANEL) * WIDTH  # panels of the values' dimensions
    most = 0
    for r in range(b):
        most = max(most, lengths[r] + news[r])
    most = (most + WIDTH * PANEL - 1) // (WIDTH * PANEL) * (WIDTH * PANEL)
    # every row's keys and values repacked once, for all of its query blocks
    key_pack = np.empty((b, kv_heads, most // PANEL, half, PANEL), dtype=np.uint32)
    value_pack = np.empty((b, kv_heads, columns, most // 2, PANEL), dtype=np.uint32)
    for pair in prange(pairs):
        r, h = pair // kv_heads, pair % kv_heads
        key_panels(k[slots[r], h], lengths[r] + news[r], key_pack[r, h])
        value_panels(v[slots[r], h], lengths[r] + news[r], value_pack[r, h])
    for task in prange(pairs * blocks):
        # blocks zigzag (first, last, second, second last, ...): later blocks see more keys, and each thread's
        # contiguous share of the tasks gets a mix
        j = task // pairs
        block = j // 2 if j % 2 == 0 else blocks - 1 - j // 2
        r, h = (task % pairs) // kv_heads, (task % pairs) % kv_heads
        first = block * QUERY_BLOCK
        end = min(num_new, first + QUERY_BLOCK)
        last = min(end, news[r])  # the block's real tokens: first .. last - 1
        for t in range(max(first, last), end):
            for g in range(group):
                out[r, t, h * group + g, :] = 0
        if last > first:
            _attend_block(q[r], key_pack[r, h], value_pack[r, h], h, first, last, lengths[r], group, scale, out[r])


@njit(cache=True)
def _attend_block(q, key_pack, value_pack, h, first, last, length, group, scale, out):  # pragma: no cover
    """One row's tokens first .. last - 1 for key/value head h's query heads (attend's task): q uint32 [T, H, d / 2]
    and out uint16 [T, H, d] (bf16 bits) of that row; key_pack / value_pack its head's repacked keys and values."""
    half, dim = q.shape[2], out.shape[2]
    columns = value_pack.shape[0]
    count = last - first
    n = length + last  # keys the block's last token sees; the others see a prefix of them
    width = (n + WIDTH * PANEL - 1) // (WIDTH * PANEL) * (WIDTH * PANEL)
    rows = group * count  # the group's query heads stacked: row g x count + i is head g's token first + i
    queries = np.empty((rows, half), dtype=np.uint32)
    for g in range(group):
        for i in range(count):
            queries[g * count + i, :] = q[first + i, h * group + g, :]
    scores = np.empty((rows, width), dtype=np.float32)
    product(queries, key_pack, scores, rows, width // PANEL)
    weights = np.empty((rows, width // 2), dtype=np.uint32)
    halves = weights.view(np.uint16)
    totals = np.empty(rows, dtype=np.float32)
    for row in range(rows):
        seen = length + first + row % count + 1
        totals[row] = softmax_to_bf16(scores[row], seen, width, scale, halves[row])
    sums = np.empty((rows, columns * PANEL), dtype=np.float32)
    product(weights, value_pack, sums, rows, columns)
    for g in range(group):
        for i in range(count):
            inverse = np.float32(1.0) / totals[g * count + i]
            for x in range(dim):
                out[first + i, h * group + g, x] = f32_to_bf16(sums[g * count + i, x] * inverse)  # nearest even
