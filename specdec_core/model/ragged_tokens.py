"""Per-token modules of a padded forward run on the real tokens only.

A batched verify step is padded: rows drafting k_r tokens are fed as one [b, T] block with T = 1 + max k_r, so a
step where 4 of 16 rows verify 8 tokens computes 144 tokens for 48 real ones. On a CPU the linear layers' cost grows
with the tokens they multiply, so the padding is paid in full. Every module that acts on each token alone (the
attention's q/k/v/o projections and the MLP) is hooked: before it runs, the real tokens of the flattened [b x T, H]
input are gathered into [N, H]; after, its [N, out] output is scattered back into zeros at those places. Attention
itself still sees the padded [b, T] layout its kernels need, and padding nodes get zero projections: finite keys
past the row's length, which the masks hide and the next step overwrites.

On this project's AVX2 CPU it makes padded verify steps much cheaper; with no padding it is a little slower (the
gathers), so forwards with little padding skip it (`worth_it`; decisions.md: specdec_core/model/ragged_tokens.py).

Why hooks rather than wrapper modules: the modules keep their identity and weights (the attention probe reads
q_proj.weight; captured hidden states come from the decoder layers' outputs, untouched). They are registered for one
forward and removed after it, so no other forward pays for them.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..kernels.packed_linear import PackedLinear
from ..kernels.panel_linear import PanelLinear

MAX_REAL_SHARE = 0.75  # gather only when at most this share of the [b, T] block is real tokens
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class RaggedTokens:
    """The per-token modules of a model's decoder layers; hooked only inside `only(real)`, so every other forward
    (HF `generate` on the same model, prefill, plain steps) runs the modules untouched, without even idle hooks."""

    def __init__(self, layers):
        self.modules: list[torch.nn.Module] = []
        for layer in layers:
            attention = getattr(layer, "self_attn", None)
            for name in ATTENTION_PROJECTIONS:
                if isinstance(getattr(attention, name, None), (torch.nn.Linear, PackedLinear, PanelLinear)):
                    self.modules.append(getattr(attention, name))
            if _dense_mlp(getattr(layer, "mlp", None)):
                self.modules.append(layer.mlp)
        self.index: torch.Tensor | None = None  # [N] flat positions of the real tokens in [b x T]
        self.shape: tuple[int, int] = (0, 0)  # (b, T) of the running forward

    @property
    def hooked(self) -> int:
        return len(self.modules)

    @staticmethod
    def worth_it(real: torch.Tensor, max_real_share: float = MAX_REAL_SHARE) -> bool:
        """real [b, T] bool: whether gathering pays (enough padding, more than one token per row)."""
        return real.shape[1] > 1 and int(real.sum()) <= max_real_share * real.numel()

    @contextmanager
    def only(self, real: torch.Tensor):
        """Within this block, hooked modules compute the tokens where real [b, T] is True, and zeros elsewhere."""
        self.index = real.reshape(-1).nonzero().squeeze(1)
        self.shape = tuple(real.shape)
        handles = []
        try:
            for module in self.modules:
                handles.append(module.register_forward_pre_hook(self._gather))
                handles.append(module.register_forward_hook(self._scatter))
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.index = None

    def _gather(self, module, args):
        hidden = args[0]  # [b, T, H]
        self.index = self.index.to(hidden.device)
        # [1, N, H]: modules that unpack (batch, sequence, hidden) still can
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index)[None],) + tuple(args[1:])

    def _scatter(self, module, args, output):
        b, num_new = self.shape
        output = output.reshape(-1, output.shape[-1])  # [N, out]
        full = output.new_zeros(b * num_new, output.shape[-1])  # [b x T, out]
        full.index_copy_(0, self.index, output)
        return full.view(b, num_new, -1)


def _dense_mlp(module) -> bool:
    """A feed-forward block that maps each token alone and returns one tensor. Mixture-of-experts blocks (routers,
    auxiliary outputs, shape assumptions) keep the padded layout."""
    if not isinstance(module, torch.nn.Module):
        return False
    name = type(module).__name__.lower()
    return not ("moe" in name or "sparse" in name or "expert" in name
                or any(hasattr(module, attr) for attr in ("experts", "router", "gate_network")))
