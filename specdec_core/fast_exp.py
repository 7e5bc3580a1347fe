"""exp inside numba kernels as plain arithmetic that vectorises: numba has no vector math library here, so np.exp is
a libm call per value, and a 1,000-token prefill's attention takes ~15 million of them a layer. Imported by the
compiled attention kernels only: it imports numba."""

import numpy as np
from numba import njit

from .bf16_bits import f32_from_bits


@njit(fastmath=True, cache=True, inline="always")
def exp_nonpositive(z):  # pragma: no cover - compiled
    """exp(z) for one fp32 z <= 0: 2^k x exp(r), |r| <= ln 2 / 2 (Cephes' expf polynomial); below z = -87 the value
    is 0 to fp32 precision of any sum it enters."""
    z = max(z, np.float32(-87.0))
    k = np.floor(z * np.float32(1.44269504) + np.float32(0.5))
    r = z - k * np.float32(0.693359375)
    r = r - k * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * (r * r) + r + np.float32(1.0)) * f32_from_bits(np.uint32(np.int32(k) + 127) << np.uint32(23))


@njit(fastmath=True, cache=True)
def exp_shifted(scores, n, peak):  # pragma: no cover - compiled
    """scores[j] = exp(scores[j] - peak) for j < n (peak >= every score, so each is <= 1) -> their fp32 sum, added
    in index order."""
    for j in range(n):
        scores[j] = exp_nonpositive(scores[j] - peak)
    total = np.float32(0.0)
    for j in range(n):
        total += scores[j]
    return total


@njit(fastmath=True, cache=True)
def peak(scores, n):  # pragma: no cover - compiled
    """max(scores[:n]), n >= 1. A running max over one value does not vectorise (0.47 ns a value on an AMD EPYC,
    twice exp_shifted's cost); 16 running maxima, one a lane, do. The maximum is the same in any order."""
    lanes = np.full(16, scores[0], dtype=np.float32)
    whole = n // 16 * 16
    for j in range(0, whole, 16):
        for lane in range(16):
            lanes[lane] = max(lanes[lane], scores[j + lane])
    for j in range(whole, n):
        lanes[0] = max(lanes[0], scores[j])
    best = lanes[0]
    for lane in range(1, 16):
        best = max(best, lanes[lane])
    return best
