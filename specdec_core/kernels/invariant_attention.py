"""Attention whose result for a token depends only on that token's query and the keys it may see: not on how many
tokens its row feeds in the forward (1 for `ar`, k + 1 for a verify, a tree's nodes, a prefill chunk), not on the
other rows, their lengths or the batch size. With it, a lossless method's tokens equal `ar`'s bit for bit in bf16
too, as they do in fp32 (`--deterministic`). It serves the switch in fp32, and in bf16 where the CPU has no
AVX512_BF16 or the head_dim does not suit the bf16 kernels; elsewhere bf16 prompts attend through bf16_attention.py
and generated tokens through bf16_step_attention.py's exact kernel, with the same guarantee, faster.

What guarantees it: each query token's result comes from one function (`one_query`) over
1. the list of keys its token sees, in position order: the row's cached keys 0..length-1, then the new tokens it may
   attend (a chain: those before it and itself; a tree node: its ancestors and itself), so the list is the same
   as when that token is fed alone at its position (a tree's ancestors sit at node slots, in depth order);
2. with every score an fp32 dot product over head_dim in one fixed loop, the softmax in fp32 over exactly that list
   (max, exp, sum) and the weighted sum of values over it, loops that the compiler may split across vector lanes
   (fastmath), but the same way for every list of the same length;
3. the same compiled code for every query count, batch and row.
Only the list's length and contents enter the arithmetic, and for one token they are the same in every forward.
A task is up to QUERY_BLOCK new tokens of one row and key/value head: the keys and values any of them sees are first
copied into an fp32 scratch (bf16 widened exactly), once for the block, so a long prefill widens each key once per
block rather than once per query head and token (decisions.md: specdec_core/kernels/invariant_attention.py); the
copy changes no number, so the block never shows.

Compiled by numba once per machine (cached under $SPECBATCH_CACHE/numba).
"""

from __future__ import annotations

import numpy as np
import torch

from .layouts import INVARIANT_QUERY_BLOCK as QUERY_BLOCK
from .numba_kernels import LazyKernel, use_torch_threads


def _compile():
    from . import invariant_attention_kernel  # imports numba: only here, when the kernel is first used

    return invariant_attention_kernel.attend


kernel = LazyKernel(_compile, "invariant CPU attention", "")  # the compiled kernel, or None


def _as_array(buffer: torch.Tensor) -> np.ndarray:
    """A cache buffer [slots, KV, capacity, d] for the kernel, without a copy: fp32 as is, bf16 as its uint16 bits."""
    if buffer.dtype == torch.bfloat16:
        return buffer.view(torch.int16).numpy().view(np.uint16)
    if buffer.dtype != torch.float32:
        raise TypeError(f"invariant attention reads fp32 or bf16 caches, not {buffer.dtype}")
    return buffer.numpy()


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
           visible: torch.Tensor, scale: float) -> torch.Tensor:
    """query [b, H, T, d] (any float dtype); keys/values the layer's whole buffers [slots, KV, capacity, d];
    slots [b] each batch row's cache row; lengths [b] its cached keys; visible [b, T, T] bool
    -> [b, T, H, d] in the query's dtype."""
    run = kernel()
    if run is None:
        raise RuntimeError(f"the deterministic attention needs numba: {kernel.unavailable}")
    b, heads, num_new, dim = query.shape
    kv_heads = keys.shape[1]
    q = query.float().reshape(b, kv_heads, heads // kv_heads, num_new, dim).contiguous()  # [b, KV, G, T, d]
    out = torch.empty_like(q)
    use_torch_threads()
    run(q.numpy(), _as_array(keys), _as_array(values), slots.numpy().astype(np.int64),
        lengths.numpy().astype(np.int64), visible.numpy().astype(np.uint8), np.float32(scale), out.numpy())
    return out.view(b, heads, num_new, dim).transpose(1, 2).to(query.dtype)  # [b, T, H, d]
