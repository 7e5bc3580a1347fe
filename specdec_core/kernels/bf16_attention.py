"""Attention of a long bf16 forward (a prefill chunk) on a CPU with AVX512_BF16: both products through the CPU's bf16
dot-product instruction (vdpbf16ps, bf16_dot_kernel.py), each row over its own keys only.

Why: PyTorch's CPU SDPA computes bf16 attention far below the rate of a bf16 matmul on the same CPU, and it was the
largest part of a bf16 summarisation job's prefill. With a mask it also computes every masked score of a chunked
prompt. This kernel is several times faster there (decisions.md: specdec_core/kernels/bf16_attention.py).

How: a task is up to QUERY_BLOCK new tokens of one row and key/value head. It repacks the keys its last token sees
into 16-key panels (the layout the dot kernel reads; O(keys x d), against O(tokens x keys x d) of arithmetic) and the
values likewise, computes the scores of the group's query heads in one product, the softmax in fp32 over each
token's own keys (its cached ones and the new tokens up to itself), rounds the weights to bf16 (as flash attention
does before its second product) and multiplies them into the values. Against an fp32 reference it errs less than
SDPA in bf16.

Chains only (each new token sees the ones before it): a prefill, or a verify of a chain draft. Trees and CPUs
without the instruction keep their own paths.

A token's result depends on its own query and keys only, so --deterministic computes every prompt through it: each
score is one row's fixed instruction sequence over head_dim (bf16_dot.py's guarantee), the softmax runs over
exactly the keys the token sees, and the weighted sum walks key pairs (0, 1), (2, 3), ... from position 0 in order,
where the block's later keys add exact zeros. Not the block, the chunking, a prefix hit or the other rows.
"""

from __future__ import annotations

import numpy as np
import torch

from . import bf16_dot
from .layouts import BF16_ATTENTION_QUERY_BLOCK as QUERY_BLOCK
from .numba_kernels import LazyKernel, use_torch_threads

# New tokens per task. One SmolLM2 layer, ms at 16 / 32 / 64: a 1,024-token prompt 5.2 / 4.3 / 4.2, three prompts of
# 330 tokens 1.8 / 1.7 / 2.1.


def _compile():
    bf16_dot.require_cpu()
    from . import bf16_attention_kernel  # imports numba and llvmlite: only here, when the kernel is first used

    return bf16_attention_kernel.attend


kernel = LazyKernel(_compile, "the bf16 dot-product attention", "; long bf16 forwards attend through SDPA")


def available() -> bool:
    """Whether this CPU runs the kernel: the dot-product instruction (bf16_dot.py) and numba able to compile it."""
    return bf16_dot.available() and kernel() is not None


def usable(head_dim: int) -> bool:
    """Whether a model's heads suit the kernel (pairs of dimensions) on this CPU."""
    return head_dim % 2 == 0 and available()


def chain_news(visible: torch.Tensor) -> torch.Tensor | None:
    """visible [b, T, T] -> news [b], the real new tokens of each row, when every row is a chain (token t < news
    sees tokens 0..t, the padding sees nothing); None for anything else (a tree)."""
    b, num_new, _ = visible.shape
    news = visible.diagonal(dim1=1, dim2=2).sum(1)  # [b]
    real = torch.arange(num_new)[None, :] < news[:, None]  # [b, T]
    chain = torch.ones(num_new, num_new, dtype=torch.bool).tril()[None] & real[:, :, None] & real[:, None, :]
    return news if torch.equal(visible.cpu(), chain) else None


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
           news: torch.Tensor, scale: float) -> torch.Tensor:
    """query [b, H, T, d] bf16; keys/values the layer's whole bf16 buffers [slots, KV, capacity, d]; slots [b] each
    row's cache row; lengths [b] its cached keys; news [b] its new tokens (a chain) -> [b, T, H, d] bf16."""
    b, heads, num_new, dim = query.shape
    q = query.transpose(1, 2).contiguous()  # [b, T, H, d]: the fast forward's own layout, so usually no copy
    out = torch.empty(b, num_new, heads, dim, dtype=torch.bfloat16)  # written as bits: no fp32 result to convert
    use_torch_threads()
    kernel()(q.view(torch.int32).numpy().view(np.uint32), _bits(keys), _bits(values),
             slots.numpy().astype(np.int64), lengths.numpy().astype(np.int64), news.numpy().astype(np.int64),
             np.float32(scale), _bits(out))
    return out


def _bits(buffer: torch.Tensor) -> np.ndarray:
    if buffer.dtype != torch.bfloat16 or not buffer.is_contiguous():
        raise TypeError(f"bf16 attention reads contiguous bf16 caches, not {buffer.dtype}")
    return buffer.view(torch.int16).numpy().view(np.uint16)
