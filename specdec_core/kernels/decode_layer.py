"""A bf16 decode or verify step's decoder layers, each as one compiled call on a CPU with AVX512_BF16.

Why: at a small batch a step's layers are mostly host work. Each layer made ~10 calls into compiled kernels (the
norms, the four linears, RoPE and the cache write, the attention, the SiLU gate), each with its conversions between
torch and numpy, its argument checks and its own parallel region, and ~40 small tensor ops around them: ~30 % of a
batch-2 decode step (decisions.md: specdec_core/kernels/decode_layer.py). Here the same kernels run, in the same
order on the same numbers, called from one compiled function a layer, so the tokens are those of the layer-by-layer
path bit for bit (tests/specdec_core/test_decode_layer.py).

Where: bf16 weights on bf16 pair panels without a bias (bf16_dot.py) for every linear of the layer, with no kernel
plan routing one elsewhere; steps through bf16_step_attention.py (--deterministic's exact kernel too) with the
compiled RoPE. A forward that records a layer's output (PLD+ (h)) runs in pieces around it; queries (PLD+ (a))
come out of the kernel. Every other forward keeps fast_forward.py's own path.
"""

from __future__ import annotations

import numpy as np
import torch

from . import bf16_dot, bf16_step_attention, rope_store
from .numba_kernels import LazyKernel, use_torch_threads
from .panel_linear import PanelLinear


def _compile():
    bf16_dot.require_cpu()
    from . import decode_layer_kernel  # imports numba and llvmlite: only here, when first used

    return decode_layer_kernel.layer


kernel = LazyKernel(_compile, "the compiled bf16 decode layer", "; steps run layer by layer")


def weights(norm1: torch.Tensor, norm2: torch.Tensor, eps: tuple[float, float], scale: float,
            linears: list) -> tuple | None:
    """A layer's weights and settings as the kernel reads them: (norm1 bits, norm2 bits, eps [2], scale, qkv, o,
    gate_up, down panels), or None where one of its linears is not a bf16 pair-panel linear without a bias
    (`linears`: the four modules, in that order)."""
    if norm1.dtype != torch.bfloat16 or not bf16_dot.available():
        return None
    panels = []
    for module in linears:
        if type(module) is not PanelLinear or module.bias is not None or module.panels.dim() != 4:
            return None
        words = module.panels_array  # uint32 [P, in / 2, 16]
        if words.shape[0] * 16 != module.out_features or 2 * words.shape[1] != module.in_features:
            return None  # padded panels or an odd input width: the layer-by-layer path slices and pads
        panels.append(words)
    bits = rope_store.kernel_array  # a bf16 tensor's memory as uint16, no copy
    return (bits(norm1.detach()), bits(norm2.detach()), np.array(eps, dtype=np.float32), np.float32(scale),
            *panels)


def usable(step, rotation, tokens: int) -> bool:
    """Whether a forward's step attention and RoPE are the ones the kernel runs."""
    return (type(step) is bf16_step_attention.Step and type(rotation) is rope_store.RotateStore
            and tokens < rope_store.PARALLEL_MIN_TOKENS and kernel() is not None)


def run_layers(layers: list[tuple], x: torch.Tensor, delta: torch.Tensor | None, flat: torch.Tensor | None,
               shape: tuple[int, int, int, int], step, rotation, caches: tuple[list, list],
               heads: dict[int, list[int]] | None = None):
    """Consecutive layers of a step: layers[i] = weights(...) of the i-th; x [M, hidden] bf16 the residual stream
    entering them, delta [M, hidden] bf16 the MLP output still to be added to it (None: nothing); flat [M] the real
    tokens' places in b x T (None: all of them); shape (b, T, heads, key/value heads); step and rotation: the
    forward's bf16_step_attention.Step and rope_store.RotateStore; caches: (keys, values), each layer's buffer;
    heads: {i: the query heads of the i-th layer to record}
    -> (x, the last MLP's output still to be added), bf16 [M, hidden], and {i: [b, n, T, d] float32 the recorded
    heads' rotated queries, as FastForward._layer records them}."""
    run = kernel()
    use_torch_threads()
    b, num_new = shape[:2]
    places = (np.arange(b * num_new, dtype=np.int64) if flat is None
              else flat.numpy().astype(np.int64, copy=False))  # [M]
    attention = (places, *step.rows, step.exact)
    residual = rope_store.kernel_array(x)
    delta = np.zeros(tuple(x.shape), dtype=np.uint16) if delta is None else rope_store.kernel_array(delta)
    queries = {}
    for offset, (weights, keys, values) in enumerate(zip(layers, *caches)):
        residual, delta, query = run(residual, delta, weights, shape, rotation.shared,
                                     (rope_store.kernel_array(keys), rope_store.kernel_array(values)), attention)
        if heads and heads.get(offset):
            chosen = torch.from_numpy(query[:, heads[offset]]).view(torch.bfloat16).float()  # [b x T, n, d]
            queries[offset] = chosen.view(b, num_new, *chosen.shape[1:]).transpose(1, 2)  # [b, n, T, d]
    return torch.from_numpy(residual).view(torch.bfloat16), torch.from_numpy(delta).view(torch.bfloat16), queries
