"""A layer's rotary embedding of the new queries and keys, and the write of its keys and values into the slot cache,
as one compiled pass on an fp32 CPU.

In eager PyTorch these are ~14 small ops a layer (two rotate-half RoPEs, then two advanced-indexing writes), each a
dispatch and a parallel region. One pass makes a shared prefill of short prompts faster, a decode step a little
(decisions.md: specdec_core/kernels/rope_store.py). The kernel does the same arithmetic in the same
order (x * cos, then + (-x2) * sin, no fused multiply-add), so its numbers are bit-identical to the eager ops
(tests/specdec_core/test_step_kernels.py), and each token's result depends on that token alone.

Compiled by numba once per machine (cached under $SPECBATCH_CACHE/numba); without numba, or for other dtypes, the
fast forward keeps the eager ops.
"""

from __future__ import annotations

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads

PARALLEL_MIN_TOKENS = 256  # below this a parallel region costs more than the loop (a decode step feeds 16-80 tokens)


def _kernel_module():
    from . import rope_store_kernel  # imports numba: only here, when a kernel is first used

    return rope_store_kernel


def _compile():
    module = _kernel_module()
    return module.rotate_store, module.rotate_store_parallel


def _compile_bf16():
    module = _kernel_module()
    return module.rotate_store_bf16, module.rotate_store_bf16_parallel


kernels = LazyKernel(_compile, "compiled RoPE and cache write", "; using eager ops")  # (serial, parallel), or None
bf16_kernels = LazyKernel(_compile_bf16, "compiled bf16 RoPE and cache write", "; using eager ops")


class RotateStore:
    """One forward's rotation: its tokens' cos / sin and cache slots, converted once for all of its layers."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, places: torch.Tensor, compiled):
        """cos / sin [M, 1, d]; rows / places [M]: where each token's keys and values go; compiled: the (serial,
        parallel) kernels of their dtype."""
        serial, parallel = compiled
        self.shared = (kernel_array(cos[:, 0]), kernel_array(sin[:, 0]),
                       rows.numpy().astype(np.int64, copy=False), places.numpy().astype(np.int64, copy=False))
        tokens = rows.shape[0]
        if tokens >= PARALLEL_MIN_TOKENS:
            use_torch_threads()
            self.run = parallel
        else:
            self.run = serial

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor) -> torch.Tensor:
        """q [M, H, d], k / v [M, KV, d], key_cache / value_cache a layer's buffers [slots, KV, capacity, d]
        -> q rotated (in place); k rotated and v written into the cache."""
        q = q.contiguous()  # rotated in place: this tensor, not a copy of it
        self.run(kernel_array(q), kernel_array(k), kernel_array(v), *self.shared, kernel_array(key_cache),
                 kernel_array(value_cache))
        return q


def kernel_array(tensor: torch.Tensor) -> np.ndarray:
    """A numba kernel's view of a tensor: fp32 as is, bf16 as its uint16 bits; a copy only when not contiguous (q is
    rotated in place, so it must already be)."""
    tensor = tensor.contiguous()
    return tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def prepare(cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, places: torch.Tensor,
            activations: torch.Tensor, key_cache: torch.Tensor) -> RotateStore | None:
    """The compiled rotation for a forward whose activations and cache are fp32 or bf16 CPU tensors (of one dtype),
    else None (eager)."""
    dtype = activations.dtype
    compiled = {torch.float32: kernels, torch.bfloat16: bf16_kernels}.get(dtype)
    usable = (activations.device.type == "cpu" and key_cache.dtype == dtype and cos.dtype == dtype
              and compiled is not None and compiled() is not None)
    return RotateStore(cos, sin, rows, places, compiled()) if usable else None
