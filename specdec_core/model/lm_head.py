"""A model's LM head read in parts: its weight (int8 or not) and its rows for some token ids (SubsetHead)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .int8_linear import Int8WeightLinear

if TYPE_CHECKING:
    from .model_runner import ModelRunner


class SubsetHead:
    """The LM head over some token ids only: [N, hidden] -> [N, vocab] float32 logits, -inf for every other token,
    so a softmax over them is the model's distribution restricted to the ids and renormalised.

    Why: a small drafter's head can be most of its forward. Gemma 3 270M's [262,144, 640] head is most of its
    weights; restricted to the 95,970 tokens Qwen2.5 shares with it, TLI's drafting distribution (q restricted to the
    shared tokens, renormalised) comes out exactly, for a third of the head's cost. The sliced weight is copied once
    (a contiguous [S, hidden] matrix), not gathered per call."""

    def __init__(self, runner: "ModelRunner", token_ids: torch.Tensor):
        linear = runner.model.get_output_embeddings()
        self.token_ids = token_ids.to(runner.device)  # [S]
        self.weight = head_rows(linear, self.token_ids).contiguous()  # [S, hidden]
        self.bias = head_bias_rows(linear, self.token_ids)  # [S] or None
        self.vocab_size = runner.vocab_size
        self.softcap = getattr(runner.model.config, "final_logit_softcapping", None)

    def for_rows(self, rows: list[int]) -> "SubsetHead":
        """The same head for every cache row (a head that differs per row binds them here)."""
        return self

    def project(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] x [S, hidden] rows of this model's head -> [N, S] float32, soft-capped as the model does."""
        logits = torch.nn.functional.linear(hidden, weight, bias)  # [N, S]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.project(hidden, self.weight, self.bias)  # [N, S]
        full = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)  # [N, vocab]
        full[:, self.token_ids] = logits
        return full


def head_weight(linear) -> torch.Tensor:
    """[vocab, hidden] float weight of an LM head, int8-quantized (dequantized here) or not."""
    if isinstance(linear, Int8WeightLinear):
        return linear.dequantized()
    weight = linear.weight
    if callable(weight):  # torch.ao dynamic quantized Linear: weight() is a quantized tensor
        return weight().dequantize()
    return weight


def head_rows(linear, token_ids: torch.Tensor) -> torch.Tensor:
    """[S, hidden] the LM head's rows for some token ids, without dequantizing the rest of an int8 head."""
    if isinstance(linear, Int8WeightLinear):
        return linear.weight_int8[token_ids].to(linear.scale.dtype) * linear.scale[token_ids, None]
    return head_weight(linear).detach()[token_ids]


def head_bias_rows(linear, token_ids: torch.Tensor) -> torch.Tensor | None:
    """[S] the LM head's bias for some token ids (None: the head has none)."""
    bias = linear.bias() if callable(getattr(linear, "bias", None)) else getattr(linear, "bias", None)
    return bias.detach()[token_ids] if bias is not None else None
