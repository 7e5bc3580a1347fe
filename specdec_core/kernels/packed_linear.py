"""fp32 linear layers through oneDNN on a CPU, with weights reordered once into oneDNN's blocked layout.

Why: a decode step of a small model at batch 16 is a few hundred [16, hidden] x [hidden, out] matmuls, and MKL's
sgemm runs those far below the CPU's peak. oneDNN on the reordered weight beat MKL and oneDNN on the plain weight
at every row count tried (decisions.md: specdec_core/kernels/packed_linear.py). The reordered weight also gives each
row the same result whatever the number of rows (MKL's does not), so a row's numbers do not depend on its batch.

The LM head too: the reordered weight beat oneDNN on the dense one, and only the reordered weight gives a row the
same logits in any batch (--deterministic needs that).

The reordered weight is an opaque oneDNN tensor that replaces the dense one (one copy of the weights; a head tied to
the embedding gets its own copy); `weight` gives a dense copy to the few readers that need one
(the attention probe's query rows, a subset head's rows).
"""

from __future__ import annotations

import os

import torch

ROWS_HINT = 16  # the row count the layout is chosen for (the default batch); other row counts run as fast
DISABLE_ENV = "SPECBATCH_ONEDNN"  # "0": keep every linear on PyTorch's default (MKL) path


def available() -> bool:
    return (os.environ.get(DISABLE_ENV, "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def bf16_available() -> bool:
    """Whether oneDNN reorders and multiplies bf16 weights on this CPU."""
    return available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """A dense [out, in] weight -> oneDNN's opaque blocked copy of it (the weight's dtype), for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, in] x (a reordered or dense [out, in] weight) -> [M, out] through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedLinear(torch.nn.Module):
    """An fp32 nn.Linear with its weight in oneDNN's blocked layout."""

    def __init__(self, source: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.packed = reorder(source.weight)  # opaque [out, in]
        self.bias = source.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()  # [out, in], a copy

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return linear(x, self.packed, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out = self.project(x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)


def replace_linears(module: torch.nn.Module, make, dtypes=(torch.float32,)) -> int:
    """Replace every nn.Linear of one of `dtypes` under `module` with make(linear), in place; returns how many."""
    count = 0
    for name, child in module.named_children():
        plain = type(child) is torch.nn.Linear and child.weight.dtype in dtypes
        # a packed layer goes to another kernel (--deterministic's panels); never packed again
        repacked = type(child) is PackedLinear and child.dtype in dtypes and make is not PackedLinear
        if plain or repacked:
            setattr(module, name, make(child))
            count += 1
        else:
            count += replace_linears(child, make, dtypes)
    return count


def pack_linears(module: torch.nn.Module) -> int:
    """Every fp32 nn.Linear under `module` becomes a PackedLinear, in place; returns how many."""
    return replace_linears(module, PackedLinear)
