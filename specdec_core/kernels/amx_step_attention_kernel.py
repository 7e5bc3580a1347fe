"""The compiled kernel of amx_step_attention.py, at module level so numba's disk cache finds it again in the next
process. Imported only when the kernel is first used: it imports numba and llvmlite.

Tile registers: scores use tmm0 (the [16 keys x 16 queries] sums), tmm4/tmm5 (16 keys, dims 0-31 and 32-63) and
tmm6/tmm7 (the queries, transposed into pairs of dims); weighted sums use tmm0..tmm3 (16 queries x 16 dims each),
tmm4 (16 queries' weights of 32 keys) and tmm5 (32 values, paired key by key)."""

import numpy as np
from numba import njit, prange

from . import amx_tiles as tiles
from .bf16_bits import f32_to_bf16
from .fast_exp import exp_nonpositive, peak

QUERIES = tiles.ROWS  # query rows a pass over a row's keys computes (a tile's columns)
SCORE_KEYS = tiles.ROWS  # keys a score tile holds
VALUE_KEYS = 2 * tiles.ROWS  # keys a weighted-sum step reads (16 pairs)


@njit(cache=True, inline="always")
def _transposed_queries(q, r, h, group, first, count):  # pragma: no cover - compiled
    """q uint32 [b, T, H, 32] -> [32, 16] uint32: word (i, c) = query row first + c's dims 2i, 2i + 1 (query rows
    token-major: row t x G + g is token t's head h x G + g); columns past count zero."""
    out = np.zeros((32, QUERIES), dtype=np.uint32)
    for c in range(count):
        i = first + c
        head = h * group + i % group
        t = i // group
        for w in range(32):
            out[w, c] = q[r, t, head, w]
    return out


@njit(cache=True, inline="always")
def _scores(keys, n, qt, scores):  # pragma: no cover - compiled
    """scores [16, >= ceil(n / 16) x 16] fp32: scores[c, j] = query c . keys[j] (unscaled) for j < n. keys uint32
    [>= n, 32] (one key's bf16 pairs a row). Each tile of 16 keys x 16 queries is transposed into place."""
    q_address = tiles.address(qt)
    tiles.load6(q_address, 64)
    tiles.load7(q_address + 16 * 64, 64)
    tile = np.empty((SCORE_KEYS, QUERIES), dtype=np.float32)
    pad = np.zeros((SCORE_KEYS, 32), dtype=np.uint32)
    base, out = tiles.address(keys), tiles.address(tile)
    target, row_bytes = tiles.address(scores), scores.shape[1] * 4
    for first in range(0, n, SCORE_KEYS):
        if first + SCORE_KEYS <= n:
            address = base + first * 128
        else:  # the last keys, copied into a zeroed tile: nothing is read past the row's keys
            for j in range(n - first):
                pad[j, :] = keys[first + j]
            address = tiles.address(pad)
        ahead = first + 8 * SCORE_KEYS  # the keys 8 tiles on
        if ahead < n:
            tiles.prefetch(base + ahead * 128, min(SCORE_KEYS, n - ahead) * 2)
        tiles.load4(address, 128)
        tiles.load5(address + 64, 128)
        tiles.zero0()
        tiles.dot_0_4_6()
        tiles.dot_0_5_7()
        tiles.store0(out, 64)
        tiles.transpose_out(out, target + first * 4, row_bytes)


@njit(cache=True, fastmath=True, inline="always")
def _softmax(scores, n, length, visible, r, group, first, count, scale, weights):  # pragma: no cover - compiled
    """scores [16, >= n] -> weights uint32 [16, ceil(n / 32) x 16] (query c < count's bf16 weights of keys 2i, 2i + 1
    in word (c, i), rounded to nearest even; zero past key n) and each query's fp32 total. A query
    sees every cached key and the new tokens visible [b, T, T] allows it."""
    totals = np.ones(QUERIES, dtype=np.float32)
    halves = weights.view(np.uint16)
    for c in range(count):
        row = scores[c]
        t = (first + c) // group
        for j in range(length, n):  # the new tokens this query may not see (later ones, a tree's other branches)
            if visible[r, t, j - length] == 0:
                row[j] = np.float32(-1e30)
        top = peak(row, n)
        total = np.float32(0.0)
        for j in range(n):
            p = exp_nonpositive((row[j] - top) * scale)
            row[j] = p
            total += p
        for j in range(length, n):
            if visible[r, t, j - length] == 0:
                total -= row[j]
                row[j] = np.float32(0.0)
        totals[c] = total
        for j in range(n):
            halves[c, j] = f32_to_bf16(row[j])  # nearest even
        for j in range(n, halves.shape[1]):  # through the last value tile's 32 keys
            halves[c, j] = 0
    return totals


@njit(cache=True, inline="always")
def _weighted_sums(values, n, weights, sums):  # pragma: no cover - compiled
    """sums [16, 64] fp32 = weights . values[:n] (values uint16 [>= n, 64]; weights uint32 [16, >= ceil(n / 32) x
    16], zero past n). Values are paired into a scratch of 4 tiles (tiles.pair_rows); past n, zero rows."""
    tiles.zero_sums()
    paired = np.empty((4, 16, 16), dtype=np.uint32)
    nothing = np.zeros(64, dtype=np.uint16)
    p_address, p_row = tiles.address(weights), weights.shape[1] * 4
    v_address, base, zero = tiles.address(paired), tiles.address(values), tiles.address(nothing)
    for first in range(0, n, VALUE_KEYS):
        ahead = first + 4 * VALUE_KEYS
        if ahead < n:
            tiles.prefetch(base + ahead * 128, min(VALUE_KEYS, n - ahead) * 2)
        for i in range(VALUE_KEYS // 2):
            j = first + 2 * i
            low = base + j * 128 if j < n else zero
            high = base + (j + 1) * 128 if j + 1 < n else zero
            tiles.pair_rows(low, high, v_address + i * 64)
        tiles.load4(p_address + first * 2, p_row)  # words first / 2 ..
        tiles.load5(v_address, 64)
        tiles.dot_0_4_5()
        tiles.load5(v_address + 1024, 64)
        tiles.dot_1_4_5()
        tiles.load5(v_address + 2048, 64)
        tiles.dot_2_4_5()
        tiles.load5(v_address + 3072, 64)
        tiles.dot_3_4_5()
    out = tiles.address(sums)
    tiles.store0(out, 256)
    tiles.store1(out + 64, 256)
    tiles.store2(out + 128, 256)
    tiles.store3(out + 192, 256)


@njit(parallel=True, fastmath=True, cache=True)
def attend(q, k, v, slots, lengths, news, visible, group, scale, out):  # pragma: no cover - compiled
    """q uint32 [b, T, H, 32]: the bf16 pairs of each token's query heads (head_dim 64); k uint32 and v uint16
    [slots, KV, capacity, 32 | 64]; slots, lengths, news int64 [b]: each row's cache row, cached keys and real new
    tokens (the first news[r]); visible uint8 [b, T, T]; out uint16 [b, T, H, 64]: bf16 bits (padding tokens get
    zeros)."""
    b, kv_heads = q.shape[0], k.shape[1]
    config = tiles.config()
    for task in prange(b * kv_heads):
        r, h = task // kv_heads, task % kv_heads
        length, real = lengths[r], news[r]
        n = length + real  # the cached keys and this forward's real tokens
        keys, values = k[slots[r], h], v[slots[r], h]
        tiles.configure(tiles.address(config))
        scores = np.empty((QUERIES, (n + SCORE_KEYS - 1) // SCORE_KEYS * SCORE_KEYS), dtype=np.float32)
        # rows past a pass's query count are never written: they only reach sums rows that are not read
        weights = np.empty((QUERIES, (n + VALUE_KEYS - 1) // VALUE_KEYS * (VALUE_KEYS // 2)), dtype=np.uint32)
        sums = np.empty((QUERIES, 64), dtype=np.float32)
        rows = real * group
        for first in range(0, rows, QUERIES):
            count = min(QUERIES, rows - first)
            _scores(keys, n, _transposed_queries(q, r, h, group, first, count), scores)
            totals = _softmax(scores, n, length, visible, r, group, first, count, scale, weights)
            _weighted_sums(values, n, weights, sums)
            for c in range(count):
                i = first + c
                head, t = h * group + i % group, i // group
                inverse = np.float32(1.0) / totals[c]
                for x in range(64):
                    out[r, t, head, x] = f32_to_bf16(sums[c, x] * inverse)
        tiles.release()
        for t in range(real, out.shape[1]):
            for g in range(group):
                out[r, t, h * group + g, :] = 0
