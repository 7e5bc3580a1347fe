"""What one forward over the KV cache's rows computes: built once per step by its caller (the decode loop's prefill
and verify steps, a draft model's step, head discovery) and read by the runner, the fast forward and the kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [b, T] int64: each row's new tokens, padded to the longest row's T
    positions: torch.Tensor  # [b, T] int64: their positions (chain: length + t; a tree node: length + depth)
    visible: torch.Tensor  # [b, T, T] bool: visible[r, t, i] = new token t of row r may attend new token i
    logit_index: torch.Tensor  # [N, 2] int64: (row, t) pairs whose next-token logits are wanted
    rows: list[int] | None = None  # b cache slots, in order (None: every live row)
    prefill: bool = False  # the tokens are prompt tokens (bf16 --deterministic attends them through bf16_attention)
    # What the forward records besides the logits, for the drafters that read the target (target_signals.py):
    captured: dict[int, torch.Tensor | None] = field(default_factory=dict)  # {layer: None} -> [b, T, hidden] fp32
    query_heads: dict[int, list[int]] = field(default_factory=dict)  # {layer: [heads]} whose queries to record
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # filled: {layer: [b, n, T, d] fp32 post-rotary}

    @property
    def real(self) -> torch.Tensor:
        """[b, T] bool: a node sees itself; padding sees no new token."""
        return self.visible.diagonal(dim1=1, dim2=2)


@dataclass
class AttentionPlan:
    """How a forward attends, chosen once for all of its layers (ModelRunner._attention_for): at most one of
    chain, step, invariant and blocks is set; with none, SDPA with `mask` (None: one plain prompt from position 0)."""

    chain: tuple | None = None  # (lengths [b], news [b]): prompt chains (bf16_attention.py, fp32_chain_attention.py)
    chain_kernel: object = None  # the module whose attend() runs them, where the kernel plan picked another
    step: object = None  # a bf16_step_attention.Step: bf16 decode and verify steps
    invariant: tuple | None = None  # (visible [b, T, T], lengths [b]): through invariant_attention.py
    mask: object = None  # [b, 1, T, L] float (0 / dtype-min), a {layer type: mask} dict, or None
    blocks: object = None  # a flex_attention BlockMask instead of the mask (block_attention.py: GPUs, by choice)
