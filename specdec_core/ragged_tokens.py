"""Per-token modules of a padded forward run on the real tokens only.

A batched verify step is padded: rows drafting k_r tokens are fed as one [b, T] block with T = 1 + max k_r, so a
step where 4 of 16 rows verify 8 tokens computes 144 tokens for 48 real ones. On a CPU the linear layers' cost grows
with the tokens they multiply, so the padding is paid in full. Every module that acts on each token alone (the
attention's q/k/v/o projections and the MLP) is hooked: before it runs, the real tokens of the flattened [b x T, H]
input are gathered into [N, H]; after, its [N, out] output is scattered back into zeros at those places. Attention
itself still sees the padded [b, T] layout its kernels need, and padding nodes get zero projections: finite keys
past the row's length, which the masks hide and the next step overwrites.

Measured on this project's 2-core AVX2 CPU (SmolLM2 fp32, 16 rows, ~600 cached tokens, median step, with
grouped_attention.py): 4 rows verifying 2 / 4 / 8 draft tokens beside 12 plain rows cost 218 / 279 / 441 ms padded
and 178 / 215 / 320 ms this way, against 139 ms for a plain step. With no padding it is ~2 % slower (the gathers),
so forwards with little padding skip it (`worth_it`).

Why hooks rather than wrapper modules: the modules keep their identity and weights (the attention probe reads
q_proj.weight; captured hidden states come from the decoder layers' outputs, untouched).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

MAX_REAL_SHARE = 0.75  # gather only when at most this share of the [b, T] block is real tokens
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class RaggedTokens:
    """Hooks on each decoder layer's per-token modules; inactive (no gathers) outside `only(real)`."""

    def __init__(self, layers):
        self.index: torch.Tensor | None = None  # [N] flat positions of the real tokens in [b x T]
        self.shape: tuple[int, int] = (0, 0)  # (b, T) of the running forward
        self.hooked = 0
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            modules = [getattr(attention, name, None) for name in ATTENTION_PROJECTIONS] + [getattr(layer, "mlp", None)]
            for module in modules:
                if isinstance(module, torch.nn.Module):
                    module.register_forward_pre_hook(self._gather)
                    module.register_forward_hook(self._scatter)
                    self.hooked += 1

    @staticmethod
    def worth_it(real: torch.Tensor) -> bool:
        """real [b, T] bool: whether gathering pays (enough padding, more than one token per row)."""
        return real.shape[1] > 1 and int(real.sum()) <= MAX_REAL_SHARE * real.numel()

    @contextmanager
    def only(self, real: torch.Tensor):
        """Within this block, hooked modules compute the tokens where real [b, T] is True, and zeros elsewhere."""
        self.index = real.reshape(-1).nonzero().squeeze(1)
        self.shape = tuple(real.shape)
        try:
            yield
        finally:
            self.index = None

    def _gather(self, module, args):
        if self.index is None:
            return None
        hidden = args[0]  # [b, T, H]
        self.index = self.index.to(hidden.device)
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index),) + tuple(args[1:])  # [N, H]

    def _scatter(self, module, args, output):
        if self.index is None:
            return None
        b, num_new = self.shape
        full = output.new_zeros(b * num_new, output.shape[-1])  # [b x T, out]
        full.index_copy_(0, self.index, output)  # output [N, out]
        return full.view(b, num_new, -1)
