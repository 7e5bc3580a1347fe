"""Attention of a bf16 decode or verify step on the AMX tiles: each row's cached keys and values read once, as
bf16, for all of a step's queries (its tokens x its group's heads, up to 16 at a time).

Why: on an AMX CPU `vdpbf16ps` runs at half the fp32 rate, and bf16_step_attention.py's cost grew with the step's
width, while the memory it reads does not grow. A tile product of 16 x 16 x 32 is one instruction, so the step's
arithmetic all but vanishes next to reading the cache, and a verify step costs little more than a decode step's
attention (decisions.md: specdec_core/kernels/amx_step_attention.py).

How: a task is one row and key/value head. Scores are [16 keys x 16 queries] tiles of keys (read straight from the
cache rows) times the queries transposed into pairs of dims, each tile transposed into query rows; the softmax runs
per query row, in fp32; weights are rounded to bf16 (as bf16_step_attention.py and flash attention round them) and multiply 32 values
at a time, interleaved key by key into the tile's pairs. Nothing past a row's real keys is read. head_dim 64 only.
Its sums are in another order than bf16_step_attention.py's, so --deterministic keeps that kernel's exact one.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from . import bf16_step_attention
from .bf16_step_attention import _words
from .numba_kernels import LazyKernel, use_torch_threads

HEAD_DIMS = (64,)
_ARCH_PRCTL, _REQUEST_PERMISSION, _TILE_DATA = 158, 0x1023, 18  # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)


@functools.cache
def tiles_permitted() -> bool:
    """Whether this CPU has AMX tiles and Linux lets this process use them (asked once; oneDNN asks the same)."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(_ARCH_PRCTL, _REQUEST_PERMISSION, _TILE_DATA) == 0
    except (OSError, AttributeError):
        return False


def _compile():
    if not tiles_permitted():  # a tile instruction without Linux's permission is SIGILL
        raise RuntimeError("this CPU has no AMX tiles, or Linux did not let this process use them")
    from . import amx_step_attention_kernel  # imports numba and llvmlite: only here, when the kernel is first used

    return amx_step_attention_kernel.attend


kernel = LazyKernel(_compile, "the AMX step attention", "; bf16 steps use bf16_step_attention.py")


def usable(head_dim: int) -> bool:
    """Whether a model with this head_dim can run the kernel on this CPU."""
    return head_dim in HEAD_DIMS and tiles_permitted() and kernel() is not None


class Step(bf16_step_attention.Step):
    """One forward's rows as the kernel reads them, converted once for all of its layers."""

    def __init__(self, visible: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
        super().__init__(visible, lengths, slots)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """query [b, H, T, 64] bf16; keys/values a layer's whole bf16 buffers [slots, KV, capacity, 64]
        -> [b, T, H, 64] bf16."""
        b, heads, num_new, dim = query.shape
        group = heads // keys.shape[1]
        q = query.transpose(1, 2).contiguous()  # [b, T, H, d]: the fast forward's own layout
        out = torch.empty(b, num_new, heads, dim, dtype=torch.bfloat16)
        use_torch_threads()
        kernel()(_words(q), _words(keys), _halves(values), *self.rows, group, np.float32(scale), _halves(out))
        return out


def _halves(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous bf16 tensor as its uint16 bits, without a copy."""
    _words(tensor)  # its checks
    return tensor.view(torch.int16).numpy().view(np.uint16)
