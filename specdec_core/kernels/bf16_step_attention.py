"""Attention of a bf16 decode or verify step on a CPU with AVX512_BF16: each row's cached keys and values read once,
as bf16, through the CPU's bf16 dot-product instruction (vdpbf16ps).

Why: a step feeds 1..8 tokens a row against hundreds or thousands of cached keys, so its attention is a read of the
cache. The fp32 kernels widen every key and value first (invariant_attention.py copies them into an fp32 scratch)
and reduce each fp32 dot product across vector lanes: on an AMD avx512_bf16 CPU that was most of a bf16 decode
step, at a fraction of the memory's bandwidth (decisions.md: specdec_core/kernels/bf16_step_attention.py).

How: a task is one row and key/value head. Its query rows (the group's heads x the step's tokens) take each key's
scores in one pass over the keys (two instructions a key and query for head_dim 64, and one lane reduction); the
softmax is fp32 over the row's cached keys and the new tokens each query may see; the weights are rounded to bf16
(as flash attention rounds them) and multiply pairs of values, interleaved dimension by dimension, in one pass
over the values. The padding after a row's real tokens is never read.

Two kernels. `attend` sums every query's softmax over the row's key count and masks what a query may not see, so a
token's numbers depend on the step's width in the last bit. `attend_exact` (--deterministic) lists each query's own
keys in position order and sums over exactly those, in pairs from position 0, so a token's numbers are those of the
same token fed alone (a decode step), whatever the verify's width, tree, batch or neighbours; it costs a gather of
each query's few new values.
"""

from __future__ import annotations

import numpy as np
import torch

from . import bf16_dot
from .layouts import STEP_PASS_ROWS as PASS_ROWS
from .numba_kernels import LazyKernel, use_torch_threads

HEAD_DIMS = (64, 128)


def _compile():
    bf16_dot.require_cpu()
    from . import bf16_step_attention_kernel  # imports numba and llvmlite: only here, when the kernel is first used

    return bf16_step_attention_kernel.attend, bf16_step_attention_kernel.attend_exact


kernel = LazyKernel(_compile, "the bf16 dot-product step attention", "; bf16 steps use the fp32 kernel")


def usable(head_dim: int) -> bool:
    """Whether a model with this head_dim runs the kernel on this CPU."""
    return head_dim in HEAD_DIMS and bf16_dot.available() and kernel() is not None


def takes(visible: torch.Tensor) -> bool:
    """Whether every row's real tokens (those that see themselves in visible [b, T, T]) are its first ones, as the
    kernel reads them."""
    real = visible.diagonal(dim1=1, dim2=2)  # [b, T]
    return bool(torch.equal(real, torch.arange(real.shape[1])[None, :] < real.sum(1, keepdim=True)))


class Step:
    """One forward's rows as the kernel reads them, converted once for all of its layers (per layer, the checks and
    conversions were a visible share of a decode step)."""

    def __init__(self, visible: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, exact: bool = False):
        """visible [b, T, T] bool, each row's real tokens first (`takes`); lengths [b] cached keys; slots [b] each
        row's cache row; exact: each token's result a function of its own keys only (--deterministic)."""
        self.exact = exact
        if not takes(visible):
            raise ValueError("the step attention reads each row's real tokens first, then its padding")
        news = visible.diagonal(dim1=1, dim2=2).sum(1)  # [b]
        self.num_new = visible.shape[1]
        self.rows = (slots.cpu().numpy().astype(np.int64), lengths.cpu().numpy().astype(np.int64),
                     news.numpy().astype(np.int64), visible.cpu().numpy().astype(np.uint8))

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """query [b, H, T, d] bf16; keys/values a layer's whole bf16 buffers [slots, KV, capacity, d]
        -> [b, T, H, d] bf16."""
        b, heads, num_new, dim = query.shape
        group = heads // keys.shape[1]
        # [b, T, H, d]: the fast forward's own layout (a view of it, no copy); the kernel takes each key/value head's
        # query rows from it and writes its bf16 results in the same layout
        q = query.transpose(1, 2).contiguous()
        out = torch.empty(b, num_new, heads, dim, dtype=torch.bfloat16)
        use_torch_threads()
        kernel()[1 if self.exact else 0](_words(q), _words(keys), _words(values), *self.rows, group,
                                         np.float32(scale), out.view(torch.int16).numpy().view(np.uint16))
        return out


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
           visible: torch.Tensor, scale: float, exact: bool = False) -> torch.Tensor:
    """query [b, H, T, d] bf16; keys/values the layer's whole bf16 buffers [slots, KV, capacity, d]; slots [b] each
    row's cache row; lengths [b] its cached keys; visible [b, T, T] bool, each row's real tokens first (`takes`)
    -> [b, T, H, d] bf16 (one layer; a forward's layers share a Step)."""
    return Step(visible, lengths, slots, exact).attend(query, keys, values, scale)


def _words(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous bf16 tensor [..., d] as uint32 [..., d / 2] pairs, without a copy."""
    if tensor.dtype != torch.bfloat16 or not tensor.is_contiguous():
        raise TypeError(f"bf16 step attention reads contiguous bf16 tensors, not {tensor.dtype}")
    return tensor.view(torch.int32).numpy().view(np.uint32)
