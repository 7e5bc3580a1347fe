"""The residual add and the RMSNorm after it, and the MLP's SiLU gate, each as one compiled pass on a CPU (fp32 and
bf16).

A decoder layer adds its attention output to the residual stream and normalises the sum, then does the same with
its MLP output before the next layer. Eagerly that is ~7 small ops each time (add, pow, mean, add, rsqrt, mul, mul),
each a dispatch and a pass over [M, hidden]: at batch 16, ~60 such groups a step cost a few ms once the linears got
fast (panel_linear.py). Here each row is one pass: the sum, its mean square (accumulated in float64, then rounded to
fp32 as the eager mean is), and the normed row. Likewise silu(gate) * up reads the stacked gate / up output once
(panel_linear.stack computes both projections in one call).

What each output depends on: its own row's values and the norm's weight; a row's numbers are the same in any batch
and any step. They are not bit-identical to the eager ops (whose mean sums in another order), so the fast forward's
logits differ from Hugging Face's modules by float rounding (tests/specdec_core/test_fast_forward.py bounds it).

bf16 (residual_norm_kernel.py) reads and writes bf16 bits and rounds where the eager ops round. Eagerly, most of
these ops' time in bf16 went to converting between bf16 and fp32 (decisions.md: specdec_core/kernels/residual_norm.py).

Compiled by numba once per machine (cached under $SPECBATCH_CACHE/numba); without numba, or for other dtypes and
devices, the fast forward keeps the eager ops.
"""

from __future__ import annotations

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads


def _compile():
    from numba import njit, prange

    @njit(cache=True, parallel=True)
    def add_norm(x, delta, weight, eps, total_out, normed_out):  # pragma: no cover - compiled
        """x, delta [M, H] -> total_out = x + delta; normed_out = weight * (total * 1 / sqrt(mean(total^2) + eps))."""
        rows, hidden = x.shape
        for m in prange(rows):
            square = 0.0  # float64: the mean square of 576-8,960 fp32 values, summed without losing digits
            for j in range(hidden):
                value = x[m, j] + delta[m, j]
                total_out[m, j] = value
                square += np.float64(value) * np.float64(value)
            variance = np.float32(square / hidden)
            scale = np.float32(1.0) / np.sqrt(variance + eps)
            for j in range(hidden):
                normed_out[m, j] = weight[j] * (total_out[m, j] * scale)

    use_torch_threads()
    return add_norm, _kernel_module().silu_mul


kernel = LazyKernel(_compile, "the compiled residual add, RMSNorm and SiLU gate", "; using eager ops")  # or None


def _kernel_module():
    from . import residual_norm_kernel  # imports numba and llvmlite: only here, when first used

    return residual_norm_kernel


def _compile_bf16():
    module = _kernel_module()
    use_torch_threads()
    return module.add_norm_bf16, module.silu_mul_bf16


bf16_kernel = LazyKernel(_compile_bf16, "the compiled bf16 residual add, RMSNorm and SiLU gate", "; using eager ops")


def usable(x: torch.Tensor) -> bool:
    if x.device.type != "cpu":
        return False
    if x.dtype == torch.bfloat16:
        return bf16_kernel() is not None
    return x.dtype == torch.float32 and kernel() is not None


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous bf16 tensor's memory as uint16, as the bf16 kernels read and write it."""
    return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    """uint16 bits -> the bf16 tensor over the same memory."""
    return torch.from_numpy(bits).view(torch.bfloat16)


_weight_bits: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # id -> (the norm weight, kept alive; its bits)


def _held_bits(weight: torch.Tensor) -> np.ndarray:
    """_bits of a norm's weight, converted once (each layer's two norms run every forward; the host work around the
    kernel, not the kernel, was most of their time in a small batch's step)."""
    held = _weight_bits.get(id(weight))
    if held is None or held[0] is not weight:
        held = _weight_bits[id(weight)] = (weight, _bits(weight))
    return held[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [M, hidden] fp32 or bf16 (delta None: nothing to add) -> (x + delta, RMSNorm(x + delta) * weight)."""
    if x.dtype == torch.bfloat16:
        total, normed = np.empty(x.shape, dtype=np.uint16), np.empty(x.shape, dtype=np.uint16)
        addend = np.zeros(x.shape, dtype=np.uint16) if delta is None else _bits(delta)  # bf16 zero: all bits 0
        bf16_kernel()[0](_bits(x), addend, _held_bits(weight), np.float32(eps), total, normed)
        return _bf16(total), _bf16(normed)
    x = x.contiguous()
    total = np.empty(x.shape, dtype=np.float32)
    normed = np.empty(x.shape, dtype=np.float32)
    addend = np.zeros(x.shape, dtype=np.float32) if delta is None else delta.contiguous().numpy()
    kernel()[0](x.numpy(), addend, weight.numpy(), np.float32(eps), total, normed)
    return torch.from_numpy(total), torch.from_numpy(normed)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] fp32 or bf16, the gate's outputs then the up projection's -> [M, I] = silu(gate) * up, in one pass."""
    if gate_up.dtype == torch.bfloat16:
        out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.uint16)
        bf16_kernel()[1](_bits(gate_up), out)
        return _bf16(out)
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    kernel()[1](gate_up.contiguous().numpy(), out)
    return torch.from_numpy(out)
