"""bf16 linear layers on CPUs with AVX512_BF16, through the CPU's bf16 dot-product instruction (vdpbf16ps).

Why: oneDNN's bf16 linear is not row-invariant (a row's result changes with the number of rows), which
--deterministic needs; the widening panel kernel (panel_linear.py's bf16 fallback) is, but computes in fp32 FMAs at
half the rate. This kernel uses the instruction oneDNN uses, in one fixed order for every row, and beat oneDNN at
every row count tried on an AMD avx512_bf16 CPU (decisions.md: specdec_core/kernels/bf16_dot.py).

What is guaranteed: out[m, n] = bias[n] + the fp32 accumulation, over k-pairs (0, 1), (2, 3), ... in that order, of
vdpbf16ps(x[m, 2i : 2i + 2], w[n, 2i : 2i + 2]) (the instruction adds both products to the lane, with its own fixed
rounding), the same instruction sequence for every row, whether it is computed with 7 other rows or alone. A row's
numbers therefore depend on that row alone (tests/specdec_core/test_panel_linear.py checks it bitwise).

Layout: the weight [out, in] is cut into 16-column panels of k-pairs, [P, in / 2, 16, 2] bf16: the 64 bytes one
instruction reads. A task holds 8 rows x 2 panels (16 vector accumulators) while it walks k: fewer rows or columns
leave the instruction's latency exposed, more spill registers.

numba has no vector types, so the k loop is written as LLVM IR (bf16_dot_kernel.py), called from a numba loop over
(row block, panel pair); compiled once per machine, cached under $SPECBATCH_CACHE/numba.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from .layouts import DOT_INTRINSIC as INTRINSIC, DOT_PANEL as PANEL, DOT_WIDTH as WIDTH
from .numba_kernels import LazyKernel, use_torch_threads


def require_cpu() -> None:
    """Raise where this CPU lacks the dot-product instruction: LLVM asked to compile it would end the process (not
    raise), so every kernel that uses it asks first and is turned off instead (LazyKernel)."""
    if not _cpu_has_it():
        raise RuntimeError("this CPU has no AVX512_BF16 that numba compiles for")


def _compile():
    require_cpu()
    from . import bf16_dot_kernel  # imports numba and llvmlite: only here, when the kernel is first used

    use_torch_threads()
    bf16_dot_kernel.matmul.compile("(uint32[:, ::1], uint32[:, :, ::1], float32[:, ::1])")
    bf16_dot_kernel.matmul.compile("(uint32[:, ::1], uint32[:, :, ::1], uint16[:, ::1])")
    return bf16_dot_kernel.matmul


kernel = LazyKernel(_compile, "the bf16 dot-product linear kernel", "; bf16 linears widen to fp32 instead")


def available() -> bool:
    """Whether bf16 linears run through this kernel here: a CPU with AVX512_BF16 that numba compiles for (asked
    first: other CPUs neither compile it nor log about it; LLVM without the feature would end the process) and numba
    able to compile it."""
    return _cpu_has_it() and kernel() is not None


@functools.cache  # asked every forward (bf16_attention.usable), and llvmlite's feature query is slow
def _cpu_has_it() -> bool:
    if not torch.cpu._is_avx512_bf16_supported() or os.environ.get("NUMBA_CPU_NAME", "host") != "host":
        return False
    from llvmlite import binding

    return bool(binding.get_host_cpu_features().get("avx512bf16"))


def to_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [P, ceil(in / 2), 16, 2] bf16, P a multiple of WIDTH; missing columns and the odd input
    column are zeros."""
    out_features, in_features = weight.shape
    count = -(-out_features // (PANEL * WIDTH)) * WIDTH
    depth = -(-in_features // 2)
    padded = weight.new_zeros(count * PANEL, 2 * depth)
    padded[:out_features, :in_features] = weight
    return padded.view(count, PANEL, depth, 2).transpose(1, 2).contiguous()  # one copy


def dense_weight(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of to_pair_panels: [out, in], a copy."""
    count, depth = panels.shape[0], panels.shape[1]
    return panels.transpose(1, 2).reshape(count * PANEL, 2 * depth)[:out_features, :in_features]


def as_words(panels: torch.Tensor) -> np.ndarray:
    """[P, K2, 16, 2] bf16 -> the same memory as uint32 [P, K2, 16], as the kernel reads it."""
    return panels.view(torch.int32).numpy().view(np.uint32).reshape(panels.shape[:3])


def matmul(x: torch.Tensor, panels: np.ndarray, rounded: bool = False) -> np.ndarray:
    """[M, in] bf16 @ pair panels (as_words) -> [M, P x 16] float32 sums, or (rounded) the sums rounded to bf16, as
    uint16 bits: no fp32 result to write, read back and convert (a bf16 linear without a bias)."""
    depth = panels.shape[1]
    if x.shape[1] != 2 * depth:  # an odd input width: one zero column, as the panels have
        x = torch.nn.functional.pad(x, (0, 2 * depth - x.shape[1]))
    dtype = np.uint16 if rounded else np.float32
    if not depth:  # no inputs: the kernel's k loop would run once anyway
        return np.zeros((x.shape[0], panels.shape[0] * PANEL), dtype=dtype)
    out = np.empty((x.shape[0], panels.shape[0] * PANEL), dtype=dtype)  # every entry is written
    kernel()(x.contiguous().view(torch.int32).numpy().view(np.uint32), panels, out)  # x as [M, K2] words
    return out
