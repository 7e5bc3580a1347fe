"""The attention weights of chosen heads (PLD+ (a)), for every row that reads them in a step, in one compiled pass a
step on the CPU (head_attention_kernel.py). attention_probe.head_attention is the same in torch ops, a row and a
layer at a time: the kernel's reference, and the path elsewhere.

Compiled by numba once per machine (cached under $SPECBATCH_CACHE/numba).
"""

from __future__ import annotations

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads
from .rope_store import kernel_array


def _compile():
    from . import head_attention_kernel  # imports numba: only here, when the kernel is first used

    return head_attention_kernel.most_attention


kernel = LazyKernel(_compile, "compiled head attention", "; using torch ops")


def usable(keys: torch.Tensor) -> bool:
    return keys.device.type == "cpu" and keys.dtype in (torch.float32, torch.bfloat16) and kernel() is not None


def most_attention(keys: list[torch.Tensor], rows: list[int], lengths: list[int], starts: list[list[int]],
                   queries: torch.Tensor, kv_of_head: list[list[int]], wanted: torch.Tensor, scales: list[float],
                   out: torch.Tensor) -> None:
    """keys[y] [slots, KV, capacity, d] the key cache of the y-th of Y layers (usable(), one dtype); rows / lengths
    [R]: each row's cache row and its keys 0..length-1; starts [Y, R] its first visible key; queries [Y, R, n, d];
    kv_of_head [Y, n]; wanted [Y, R, n] bool; scales [Y]; out [R, >= max(lengths)] float32, raised in place to each
    wanted head's softmax weights."""
    arrays = tuple(kernel_array(layer) for layer in keys)
    use_torch_threads()
    kernel()(arrays, np.asarray(rows, dtype=np.int64), np.asarray(lengths, dtype=np.int64),
             np.asarray(starts, dtype=np.int64), queries.float().contiguous().numpy(),
             np.asarray(kv_of_head, dtype=np.int64), wanted.numpy(), np.asarray(scales, dtype=np.float32),
             out.numpy())

