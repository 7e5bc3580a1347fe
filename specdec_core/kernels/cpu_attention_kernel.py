"""The compiled loops of cpu_attention.py, at module level so numba's disk cache finds them in the next process
(a closure over the vectorised exp was keyed by a per-process id and compiled again in every process). Imported only
when first used: it imports numba.

Two loops, both blocked so that several independent sums run at once (one dot product at a time is bound by each
one's reduction): `attend` (one query a row: the group's queries in threes against four keys at once) and
`attend_wide` (a verify step's group x T queries in pairs against four keys, over CHUNK keys held in L1)."""

import numpy as np
from numba import njit, prange

from .fast_exp import exp_nonpositive

CHUNK = 64  # keys a chunk of the wide loop: 16 KB of fp32 keys (d = 64), reread from L1 by every query pair


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
