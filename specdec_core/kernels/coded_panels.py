"""fp32 weights that are exactly low-bit codes, kept as those codes: 4-bit affine blocks (w = scale * code + low,
code 0..15) or 8-bit symmetric blocks (w = scale * code, code -128..127), 32 inputs a block, one scale per output
column and block.

Why: the registry's models come from GGUF files whose linears are Q4_1 (SmolLM2) and whose embedding is Q8_0. Loaded
in fp32 (the default where the CPU has no bf16 dot product), their weights are those codes dequantized: 4 bytes a
weight that carry 4.5 or 8.5 bits. A decode step streams every weight from memory, so on such a CPU it reads ~5x
the bytes it needs. Kept as codes, the panel kernel rebuilds each panel's fp32 weights in a tile on the core
(panel_linear.py: `tile`), and sums exactly as it sums fp32 panels.

What is guaranteed: a weight is coded only where every block rebuilds it bit for bit (`encode` checks each one), and
scale * code is exact in fp32 (the scale has fp16's 11 significant bits, the code at most 8), so the kernel's one
rounding, fused or not, gives the stored fp32 weight. The sums then run over the same numbers in the same order as
the fp32 panel kernel's: the outputs are bit-identical to it (tests/specdec_core/test_coded_panels.py), and every
lossless method stays exact. A weight that is not such codes (bf16, a fine-tuned fp32 model) stays as fp32 panels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # inputs per block: GGUF's Q4_0/Q4_1/Q8_0 block
PANEL = 16  # output columns per panel (panel_linear.PANEL)
KINDS = {4: (0, 15), 8: (-128, 127)}  # bits -> the codes' range


@dataclass
class CodedPanels:
    """A weight's panels as codes: for panel p, input k, column j (of PANEL), w = scales[p, k // BLOCK, j] *
    code + lows[p, k // BLOCK, j], where the code of 4-bit panels is nibble j % 8 of codes[p, k, j % 8] (the low
    nibble for j < 8, the high one for j >= 8) and of 8-bit panels codes[p, k, j] (int8)."""

    bits: int
    codes: torch.Tensor  # [P, in, 8] uint8 (4 bits) or [P, in, 16] int8 (8 bits)
    scales: torch.Tensor  # [P, in / BLOCK, PANEL] fp32, each an fp16 value
    lows: torch.Tensor  # [P, in / BLOCK, PANEL] fp32 (zeros for 8 bits)

    dtype = torch.float32  # the weights they hold

    @property
    def shape(self) -> tuple[int, int, int]:
        """As fp32 panels' shape: [P, in, PANEL]."""
        return (self.codes.shape[0], self.codes.shape[1], PANEL)

    def dim(self) -> int:
        return 3

    def __getitem__(self, rows: slice) -> "CodedPanels":
        """Panels [start:stop]: views, no copy."""
        return CodedPanels(self.bits, self.codes[rows], self.scales[rows], self.lows[rows])

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The kernel's arguments (the same memory)."""
        return self.codes.numpy(), self.scales.numpy(), self.lows.numpy()

    def data_ptr(self) -> int:
        return self.codes.data_ptr()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.lows))

    def dense(self) -> torch.Tensor:
        """[P x PANEL, in] fp32: the weights the codes hold (panel rows past the real columns are zeros)."""
        scales = self.scales.repeat_interleave(BLOCK, dim=1)  # [P, in, PANEL]
        lows = self.lows.repeat_interleave(BLOCK, dim=1)
        weights = scales * _unpacked(self.bits, self.codes) + lows  # [P, in, PANEL]
        return weights.transpose(1, 2).reshape(-1, self.codes.shape[1])


def concat(parts: list["CodedPanels"]) -> CodedPanels:
    """The panels of several weights with one input width, one after another (a stacked q/k/v or gate/up)."""
    if len({p.bits for p in parts}) != 1:
        raise ValueError("panels of different code widths cannot share a kernel call")
    return CodedPanels(parts[0].bits, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                       torch.cat([p.lows for p in parts]))


def _unpacked(bits: int, codes: torch.Tensor) -> torch.Tensor:
    """[P, in, 8] uint8 or [P, in, 16] int8 -> [P, in, PANEL] fp32 codes."""
    if bits == 8:
        return codes.float()
    return torch.cat([codes & 15, codes >> 4], dim=2).float()


def encode(weight: torch.Tensor) -> CodedPanels | None:
    """A weight [out, in] as coded panels, 4-bit where every block is exactly such codes, else 8-bit, else None
    (not fp32, an input width not a multiple of BLOCK, or a block no code rebuilds bit for bit)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    out_features, in_features = weight.shape
    count = -(-out_features // PANEL)
    padded = torch.cat([weight, weight.new_zeros(count * PANEL - out_features, in_features)])
    blocks = padded.view(count, PANEL, in_features // BLOCK, BLOCK)  # [P, PANEL, in / BLOCK, BLOCK]
    for bits in KINDS:
        found = _codes(blocks, bits)
        if found is not None:
            codes, scales, lows = found  # [P, PANEL, in / BLOCK, BLOCK], [P, PANEL, in / BLOCK] x 2
            codes = codes.reshape(count, PANEL, in_features).transpose(1, 2)  # [P, in, PANEL]
            packed = ((codes[..., :8] | (codes[..., 8:] << 4)).to(torch.uint8) if bits == 4
                      else codes.to(torch.int8))
            return CodedPanels(bits, packed.contiguous(), scales.transpose(1, 2).contiguous(),
                               lows.transpose(1, 2).contiguous())
    return None


def _scales(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [..., BLOCK] -> (scales, lows) [...]: a block's range over the codes' range rounded to fp16 (GGUF's
    scales are fp16); 4-bit blocks start at their minimum, 8-bit ones are symmetric (lows 0)."""
    if bits == 4:
        lows = blocks.amin(-1)
        return ((blocks.amax(-1) - lows) / KINDS[4][1]).half().float(), lows
    return (blocks.abs().amax(-1) / 127).half().float(), torch.zeros(blocks.shape[:-1])


def _codes(blocks: torch.Tensor, bits: int):
    """(codes int32, scales, lows) of `bits`-bit codes that rebuild every block exactly, or None."""
    low_code, high_code = KINDS[bits]
    scales, lows = _scales(blocks, bits)
    if not torch.isfinite(scales).all() or not torch.isfinite(lows).all():
        return None
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    codes = torch.round((blocks - lows.unsqueeze(-1)) / safe).clamp(low_code, high_code)
    codes = torch.where(scales.unsqueeze(-1) > 0, codes, torch.zeros_like(codes))
    rebuilt = scales.unsqueeze(-1) * codes + lows.unsqueeze(-1)  # each product exact: one rounding, at the add
    if not torch.equal(rebuilt, blocks):
        return None
    return codes.to(torch.int32), scales, lows


def round_to_codes(weight: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """An fp32 weight [out, in] rounded to `bits`-bit block codes (what a GGUF file's dequantized weights are): for
    tests and for timing the coded kernel on random weights."""
    out_features, in_features = weight.shape
    blocks = weight.float().view(out_features, in_features // BLOCK, BLOCK)
    scales, lows = (t.unsqueeze(-1) for t in _scales(blocks, bits))
    codes = torch.round((blocks - lows) / scales.clamp(min=1e-30)).clamp(*KINDS[bits])
    return (scales * codes + lows).view(out_features, in_features)
