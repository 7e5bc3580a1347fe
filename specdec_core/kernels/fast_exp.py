"""exp inside numba kernels as plain arithmetic that vectorises: numba has no vector math library here, so np.exp is
a libm call per value, and a 1,000-token prefill's attention takes ~15 million of them a layer. Imported by the
compiled attention kernels only: it imports numba."""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .bf16_bits import f32_from_bits

LANES = 16  # floats a vector max reads at once (one AVX-512 register; two AVX2 ones)


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


@intrinsic
def _vector_peak(typingctx, scores, whole):
    """max(scores[:whole]) of a contiguous float32 array, whole a positive multiple of LANES: LANES running maxima,
    one a lane, over vector loads, then reduced. numba does not vectorise a running max (a compare and a select a
    value, which cost more than exp_shifted's exp and sum)."""
    if not (isinstance(scores, types.Array) and scores.ndim == 1 and scores.layout == "C"
            and scores.dtype == types.float32):
        return None  # (vector loads need a contiguous float32 row)

    def codegen(context, builder, signature, args):
        i64, f32 = ir.IntType(64), ir.FloatType()
        vector = ir.VectorType(f32, LANES)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        count = builder.udiv(args[1], ir.Constant(i64, LANES))
        vectors = builder.bitcast(data, vector.as_pointer())
        entry, loop, done = builder.block, builder.append_basic_block("peak"), builder.append_basic_block("peaked")
        first = builder.load(vectors, align=4)
        builder.cbranch(builder.icmp_unsigned(">", count, ir.Constant(i64, 1)), loop, done)
        builder.position_at_end(loop)
        index = builder.phi(i64)
        best = builder.phi(vector)
        index.add_incoming(ir.Constant(i64, 1), entry)
        best.add_incoming(first, entry)
        value = builder.load(builder.gep(vectors, [index]), align=4)
        higher = builder.select(builder.fcmp_ordered(">", value, best), value, best)
        following = builder.add(index, ir.Constant(i64, 1))
        index.add_incoming(following, loop)
        best.add_incoming(higher, loop)
        builder.cbranch(builder.icmp_unsigned("<", following, count), loop, done)
        builder.position_at_end(done)
        maxima = builder.phi(vector)
        maxima.add_incoming(first, entry)
        maxima.add_incoming(higher, loop)
        result = builder.extract_element(maxima, ir.Constant(ir.IntType(32), 0))
        for lane in range(1, LANES):
            other = builder.extract_element(maxima, ir.Constant(ir.IntType(32), lane))
            result = builder.select(builder.fcmp_ordered(">", other, result), other, result)
        return result

    return types.float32(scores, whole), codegen


@njit(fastmath=True, cache=True)
def peak(scores, n):  # pragma: no cover - compiled
    """max(scores[:n]) of a contiguous float32 array, n >= 1: whole vectors through _vector_peak, the rest one at a
    time. The maximum is the same in any order."""
    whole = n // LANES * LANES
    best = _vector_peak(scores, whole) if whole else scores[0]
    for j in range(whole, n):
        if scores[j] > best:
            best = scores[j]
    return best
