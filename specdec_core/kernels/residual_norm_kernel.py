"""The bf16 kernels of residual_norm.py and its fp32 SiLU gate, at module level so numba's disk cache finds them in
the next process (they call the bf16 intrinsics and the vectorised exp). Imported only when first used: it imports
numba and llvmlite.

Each rounds to bf16 where the eager bf16 ops round (the residual sum, the normalised row before the weight, the
product with the weight; silu(gate), then its product with up), so the numbers are those of the eager ops up to the
mean square's summation order and exp's last fp32 bit."""

import numpy as np
from numba import njit, prange

from .bf16_bits import bf16_to_f32, f32_to_bf16
from .fast_exp import exp_nonpositive


@njit(cache=True, parallel=True, fastmath=True)  # fastmath: the mean square's sum vectorises
def add_norm_bf16(x, delta, weight, eps, total_out, normed_out):  # pragma: no cover - compiled
    """x, delta [M, H], weight [H] bf16 bits (uint16) -> total_out = x + delta, normed_out = weight x RMSNorm(total),
    both bf16 bits [M, H]."""
    rows, hidden = x.shape
    for m in prange(rows):
        square = 0.0  # float64, as the fp32 kernel
        for j in range(hidden):
            bits = f32_to_bf16(bf16_to_f32(x[m, j]) + bf16_to_f32(delta[m, j]))
            total_out[m, j] = bits
            value = np.float64(bf16_to_f32(bits))
            square += value * value
        scale = np.float32(1.0) / np.sqrt(np.float32(square / hidden) + eps)
        for j in range(hidden):
            normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(total_out[m, j]) * scale))
            normed_out[m, j] = f32_to_bf16(bf16_to_f32(weight[j]) * normed)


@njit(cache=True, parallel=True, fastmath=True)
def silu_mul_bf16(gate_up, out):  # pragma: no cover - compiled
    """gate_up [M, 2I] bf16 bits (gate, then up) -> out [M, I] = silu(gate) x up, bf16 bits."""
    rows, width = out.shape
    for m in prange(rows):
        for j in range(width):
            gate = bf16_to_f32(gate_up[m, j])
            e = exp_nonpositive(-abs(gate))  # exp(-|gate|): the sigmoid without overflow on either side
            sigmoid = np.float32(1.0) / (np.float32(1.0) + e) if gate >= 0 else e / (np.float32(1.0) + e)
            silu = bf16_to_f32(f32_to_bf16(gate * sigmoid))
            out[m, j] = f32_to_bf16(silu * bf16_to_f32(gate_up[m, width + j]))


@njit(cache=True, parallel=True, fastmath=True)
def silu_mul(gate_up, out):  # pragma: no cover - compiled
    """gate_up [M, 2I] fp32 (gate, then up) -> out [M, I] = silu(gate) x up. The sigmoid through the vectorised exp
    (libm's exp, a call a value, was most of the gate's time: decisions.md, session 35); within 2 ulp as before."""
    rows, width = out.shape
    for m in prange(rows):
        for j in range(width):
            gate = gate_up[m, j]
            e = exp_nonpositive(-abs(gate))
            sigmoid = np.float32(1.0) / (np.float32(1.0) + e) if gate >= 0 else e / (np.float32(1.0) + e)
            out[m, j] = gate * sigmoid * gate_up[m, width + j]
