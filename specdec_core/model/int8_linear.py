"""Int8 weights for a draft model's linear layers (a drafter-only choice: engine.default_drafter_dtype)."""

from __future__ import annotations

import warnings

import torch

# Rows of input from which an int8 linear dequantizes its weight and runs a bf16 GEMM: the weight-only kernel is
# faster for a few rows (memory-bound) and slower for many (decisions.md: specdec_core/model/int8_linear.py).
DEQUANTIZE_ROWS = 128


class Int8WeightLinear(torch.nn.Module):
    """A linear layer with int8 weights (symmetric, one scale per output channel) and bf16 activations: PyTorch's
    weight-only int8 CPU kernel reads half the bytes a bf16 weight takes, and a small model's decode forward is bound
    by reading its weights. Teacher-forced, its argmax stayed the bf16 model's at almost every position, and matched
    the target's next token as often (decisions.md: specdec_core/model/int8_linear.py)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [out]
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))  # [out], the activations' dtype
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized(self) -> torch.Tensor:
        return self.weight_int8.to(self.scale.dtype) * self.scale[:, None]  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features).to(self.scale.dtype)  # [M, in]
        if flat.shape[0] >= DEQUANTIZE_ROWS:  # a prompt catch-up: compute-bound, where bf16 GEMM is faster
            out = torch.nn.functional.linear(flat, self.dequantized())
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model) -> None:
    """Every nn.Linear of `model` (the LM head included) -> int8 weights with per-output-channel scales, in place.

    A bf16 model gets weight-only int8 (Int8WeightLinear; activations stay bf16). An fp32 model (a CPU without fast
    bf16) gets PyTorch's dynamic quantization (fbgemm; activations quantized on the fly): the weight-only kernel
    has no fast fp32 path (far slower than an fp32 linear). Dynamic quantization costs acceptance.

    Why: a small drafter's decode forward is memory-bound, and its head can be most of it; in int8 the head reads
    far fewer bytes (decisions.md: specdec_core/model/int8_linear.py). torch.ao's dynamic quantization is deprecated
    upstream but present in the pinned torch."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.bfloat16:
        _replace_linears(model)
        return
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices (once per linear layer)
        quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def _replace_linears(module: torch.nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Int8WeightLinear(child))
        else:
            _replace_linears(child)
