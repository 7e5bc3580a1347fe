"""bf16 linears on the AMX tiles for decode- and verify-sized row counts: the weights packed once into tiles of
pairs, each tile read from memory once a call for every block of 16 rows.

Why: a decode step's linears are reads of the weights. On an AMX CPU oneDNN's packed bf16 linears streamed them
well below the memory's rate at decode-sized row counts, where one tile product per 1 kB weight tile leaves the call
bound by memory alone (decisions.md: specdec_core/kernels/amx_linear.py). A candidate of the kernel plan
(linear_plan.py): it runs where it timed faster.

How: W [N, K] is held as [ceil(N / 64) x 4 strips, ceil(K / 32) chunks] tiles, strip s's chunk c holding columns
16 s .. 16 s + 15 and inputs 32 c .. 32 c + 31 in pairs (the tile product's layout); zero past N and K. x is padded
to whole blocks of 16 rows and 32 inputs only where it is not already.
"""

from __future__ import annotations

import numpy as np
import torch

from . import amx_step_attention
from .numba_kernels import LazyKernel, use_torch_threads

STRIP_COLUMNS, CHUNK, ROWS = 16, 32, 16
GROUP_COLUMNS = 64  # a task's four strips


def _compile():
    if not amx_step_attention.tiles_permitted():  # a tile instruction without Linux's permission is SIGILL
        raise RuntimeError("this CPU has no AMX tiles, or Linux did not let this process use them")
    from . import amx_linear_kernel  # imports numba and llvmlite: only here, when the kernel is first used

    return amx_linear_kernel.linear


kernel = LazyKernel(_compile, "the AMX linear", "; the plan keeps oneDNN")


def usable() -> bool:
    return amx_step_attention.tiles_permitted() and kernel() is not None


def pack(weight: torch.Tensor) -> np.ndarray:
    """[N, K] bf16 -> uint32 [ceil(N / 64) x 4, ceil(K / 32), 16, 16]: tile (s, c) row i, word j = the bf16 pair
    (W[16 s + j, 32 c + 2 i], W[16 s + j, 32 c + 2 i + 1]); zero past N and K."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // GROUP_COLUMNS) * GROUP_COLUMNS, -(-k // CHUNK) * CHUNK, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    bits = padded.view(torch.int16).numpy().view(np.uint16)
    strips, chunks = bits.shape[0] // STRIP_COLUMNS, bits.shape[1] // CHUNK
    tiled = bits.reshape(strips, STRIP_COLUMNS, chunks, CHUNK // 2, 2).transpose(0, 2, 3, 1, 4)  # [s, c, i, j, pair]
    return np.ascontiguousarray(tiled).reshape(strips, chunks, CHUNK // 2, 2 * STRIP_COLUMNS).view(np.uint32)


def linear(x: torch.Tensor, packed: np.ndarray, out_features: int) -> torch.Tensor:
    """x [M, K] bf16 -> [M, out_features] bf16 = x . W^T through the packed W (pack)."""
    rows, inputs = x.shape
    blocks, width = -(-rows // ROWS) * ROWS, packed.shape[1] * CHUNK
    if (blocks, width) != (rows, inputs) or not x.is_contiguous():
        padded = x.new_zeros(blocks, width)
        padded[:rows, :inputs] = x
        x = padded
    out = torch.empty(blocks, packed.shape[0] * STRIP_COLUMNS, dtype=torch.bfloat16)
    use_torch_threads()
    kernel()(x.view(torch.int16).numpy().view(np.uint16), packed, out.view(torch.int16).numpy().view(np.uint16))
    if out.shape != (rows, out_features):
        out = out[:rows, :out_features].contiguous()
    return out
