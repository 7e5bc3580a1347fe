"""fp32 (and bf16) linear layers on a CPU through one numba kernel over weights cut into 16-column panels.

bf16 weights go to bf16_dot.py's kernel (the CPU's bf16 dot product over k-pairs) where the CPU has AVX512_BF16;
elsewhere this kernel reads them as bits widened exactly to fp32 and sums as below (row-invariant, but slower than
oneDNN's bf16 from 16 rows up). The rest of this note is about the fp32 kernel.

Why: a decode step of a small model is a few hundred [16, hidden] x [hidden, out] products whose weights come from
memory once a step. oneDNN's kernel on its reordered weight reads them far slower than this machine streams, and
those products were most of a step. Here each panel is one
contiguous [in, 16] block read front to back (the hardware prefetcher keeps up), while 4 rows x 16 columns of sums
sit in registers. docs/decisions.md has the measurements.

What is guaranteed: out[m, n] = bias[n] + sum over k = 0, 1, ... of x[m, k] * w[n, k], accumulated in that order in
fp32 (with fused multiply-adds where the CPU has them), by the same instructions for every row. A row's numbers
therefore depend on that row alone: not on how many rows share the call, nor on the row's place among them, nor on
whether the call is a prefill or a decode step (tests/specdec_core/test_panel_linear.py checks it bitwise). That is
what --deterministic needs of the linears, and it holds across prefill and decode, which oneDNN's did not promise.

The kernel's body (4 rows x 16 columns of scalar sums that LLVM's SLP vectorizer packs into AVX registers) is
generated (`kernel_source`), written once under $SPECBATCH_CACHE/numba and imported from there, so numba's disk
cache keeps the compiled code across processes (it is compiled once). Without numba, or where
it cannot compile, the linears stay on oneDNN (packed_linear.py).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from . import bf16_dot, coded_panels
from .numba_kernels import LazyKernel, load_generated, slp_vectorized, use_torch_threads
from .packed_linear import replace_linears

PANEL = 16  # output columns per panel: two AVX registers of fp32
ROWS = 4  # rows whose sums are held in registers together (4 rows of 2 accumulators + 2 weights + 1 broadcast of 16)
ROW_BLOCK = 256  # the most rows of x per task (blocks of equal size, so no thread waits on a short one)
DISABLE_ENV = "SPECBATCH_PANEL_LINEAR"  # "0": keep every linear on oneDNN (packed_linear.py)
MODULE_NAME = "specbatch_panel_kernel"


# The bf16 kernel reads its weights as uint16 bits and widens each exactly to fp32 (bf16_bits.py), so it reads half
# the bytes of the fp32 kernel and sums the same way.
KERNELS = {torch.float32: ("panel_matmul", "float32", "panels[p, k, {j}]"),
           torch.bfloat16: ("panel_matmul_bf16", "uint16", "bf16_to_f32(panels[p, k, {j}])")}


# Coded panels (coded_panels.py): each task first rebuilds its panel's fp32 weights in a tile, then sums over the
# tile exactly as the fp32 kernel sums over its panel. code bits -> (function, the codes' type, code j's expression).
# A byte's two 4-bit codes are split in fp32 (c = low + 16 high, all small integers, so exact): integer nibble
# operations widen to int64 in numba, whose conversion to fp32 AVX2 cannot vectorize.
CODED = {4: ("panel_matmul_coded4", "uint8", "l{c}", "h{c}"),
         8: ("panel_matmul_coded8", "int8", "c{j}", None)}


def kernel_source() -> str:
    """The numba module: out[M, P x PANEL] = x[M, K] @ panels[P, K, PANEL], parallel over (row block, panel), one
    function per weight dtype (KERNELS) and per code width of coded panels (CODED)."""
    lines = ["import numpy as np", "from numba import njit, prange", "", "from specdec_core.kernels.bf16_bits import bf16_to_f32"]
    for name, _, load in KERNELS.values():
        lines += _kernel_lines(name, load)
    for bits in CODED:
        lines += _kernel_lines(CODED[bits][0], "tile[k, {j}]", "codes, scales, lows", _tile_lines(bits))
    return "\n".join(lines) + "\n"


def _tile_lines(bits: int) -> list[str]:
    """The task's panel p rebuilt from its codes: tile[K, PANEL] = scales * codes + lows, block by block."""
    _, _, first, second = CODED[bits]
    lines = ["        tile = np.empty((depth, 16), dtype=np.float32)",
             f"        for b in range(depth // {coded_panels.BLOCK}):",
             "            " + ", ".join(f"d{j}" for j in range(PANEL)) + " = "
             + ", ".join(f"scales[p, b, {j}]" for j in range(PANEL)),
             "            " + ", ".join(f"o{j}" for j in range(PANEL)) + " = "
             + ", ".join(f"lows[p, b, {j}]" for j in range(PANEL)),
             f"            for k in range(b * {coded_panels.BLOCK}, (b + 1) * {coded_panels.BLOCK}):"]
    stored = PANEL // 2 if bits == 4 else PANEL
    lines.append("                " + ", ".join(f"c{c}" for c in range(stored)) + " = "
                 + ", ".join(f"np.float32(codes[p, k, {c}])" for c in range(stored)))
    if bits == 4:
        lines += [f"                h{c} = np.floor(c{c} * np.float32(0.0625))" for c in range(stored)]
        lines += [f"                l{c} = c{c} - np.float32(16.0) * h{c}" for c in range(stored)]
    for j in range(PANEL):
        code = (first.format(c=j) if j < 8 else second.format(c=j - 8)) if bits == 4 else first.format(j=j)
        lines.append(f"                tile[k, {j}] = d{j} * {code} + o{j}")
    return lines


def _kernel_lines(name: str, load: str, weights: str = "panels", preamble: list[str] = ()) -> list[str]:
    lines = [
        "",
        "",
        "@njit(cache=True, parallel=True, fastmath={'contract'}, boundscheck=False, error_model='numpy')",
        f"def {name}(x, {weights}, out):",
        "    rows, depth = x.shape",
        f"    count = {weights.split(',')[0]}.shape[0]",
        f"    blocks = max(1, (rows + {ROW_BLOCK - 1}) // {ROW_BLOCK})",
        f"    size = ((rows + blocks - 1) // blocks + {ROWS - 1}) // {ROWS} * {ROWS}",  # equal blocks
        "    for task in prange(blocks * count):",
        "        p = task % count",
        "        first = (task // count) * size",
        "        last = min(rows, first + size)",
        f"        held = first + (last - first) // {ROWS} * {ROWS}",
        *preamble,
        f"        for m in range(first, held, {ROWS}):",
    ]
    zeros = ", ".join(["np.float32(0.0)"] * PANEL)
    for i in range(ROWS):
        lines.append("            " + ", ".join(f"s{i}_{j}" for j in range(PANEL)) + f" = {zeros}")
    lines.append("            for k in range(depth):")
    lines += [f"                w{j} = " + load.format(j=j) for j in range(PANEL)]
    for i in range(ROWS):
        lines.append(f"                x{i} = x[m + {i}, k]")
        lines += [f"                s{i}_{j} += x{i} * w{j}" for j in range(PANEL)]
    for i in range(ROWS):
        lines += [f"            out[m + {i}, p * {PANEL} + {j}] = s{i}_{j}" for j in range(PANEL)]
    # the rows left over: two at a time, then one (the same sums; one at a time, 1-3 passes over the panel with
    # half the accumulator chains, latency-bound)
    lines.append("        pairs = held + (last - held) // 2 * 2")
    lines.append("        for m in range(held, pairs, 2):")
    for i in range(2):
        lines.append("            " + ", ".join(f"u{i}_{j}" for j in range(PANEL)) + f" = {zeros}")
    lines.append("            for k in range(depth):")
    lines += [f"                w{j} = " + load.format(j=j) for j in range(PANEL)]
    for i in range(2):
        lines.append(f"                x{i} = x[m + {i}, k]")
        lines += [f"                u{i}_{j} += x{i} * w{j}" for j in range(PANEL)]
    for i in range(2):
        lines += [f"            out[m + {i}, p * {PANEL} + {j}] = u{i}_{j}" for j in range(PANEL)]
    lines.append("        for m in range(pairs, last):")
    lines.append("            " + ", ".join(f"t{j}" for j in range(PANEL)) + f" = {zeros}")
    lines.append("            for k in range(depth):")
    lines.append("                xm = x[m, k]")
    lines += [f"                t{j} += xm * " + load.format(j=j) for j in range(PANEL)]
    lines += [f"            out[m, p * {PANEL} + {j}] = t{j}" for j in range(PANEL)]
    return lines


def _compile(dtype: torch.dtype | int):
    """The kernel for `dtype` panels, or for coded panels of that many bits."""
    module = load_generated(MODULE_NAME, kernel_source())
    use_torch_threads()
    if dtype in CODED:
        name, code_type = CODED[dtype][:2]
        weights = f"{code_type}[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1]"
    else:
        name, weight_type, _ = KERNELS[dtype]
        weights = f"{weight_type}[:, :, ::1]"
    with slp_vectorized():  # the 64 sums into AVX registers
        getattr(module, name).compile(f"(float32[:, ::1], {weights}, float32[:, ::1])")
    return getattr(module, name)


kernels = {dtype: LazyKernel(lambda dtype=dtype: _compile(dtype), f"the {dtype} panel linear kernel",
                             "; linears stay on oneDNN") for dtype in KERNELS}
coded_kernels = {bits: LazyKernel(lambda bits=bits: _compile(bits), f"the {bits}-bit coded panel kernel",
                                  "; coded weights stay fp32 panels") for bits in CODED}
DTYPES = tuple(KERNELS)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether `dtype` linears on this machine run through the panel kernel (it compiles on the first call)."""
    return os.environ.get(DISABLE_ENV, "1") != "0" and dtype in kernels and kernels[dtype]() is not None


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / PANEL), in, PANEL] in the weight's dtype (fp32 or bf16), contiguous; missing columns
    are zeros."""
    out_features, in_features = weight.shape
    count = -(-out_features // PANEL)
    if out_features != count * PANEL:
        weight = torch.cat([weight, weight.new_zeros(count * PANEL - out_features, in_features)])
    return weight.view(count, PANEL, in_features).transpose(1, 2).contiguous()  # one copy


def as_kernel_array(panels: torch.Tensor | coded_panels.CodedPanels) -> np.ndarray | tuple:
    """The panels' memory as their kernel reads it (no copy): fp32 as is, bf16 as its uint16 bits, bf16 pair
    panels [P, K2, 16, 2] as uint32 words (bf16_dot.py), coded panels as (codes, scales, lows)."""
    if isinstance(panels, coded_panels.CodedPanels):
        return panels.arrays()
    if panels.dim() == 4:
        return bf16_dot.as_words(panels)
    if panels.dtype == torch.bfloat16:
        return panels.view(torch.int16).numpy().view(np.uint16)
    return panels.numpy()


def linear(x: torch.Tensor, panels: np.ndarray | tuple, bias: torch.Tensor | None, out_features: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[M, in] x panels of an [out, in] `dtype` weight (as_kernel_array) -> [M, out] in `dtype`, summed in fp32
    (a bf16 result is the fp32 sum plus bias rounded once, as oneDNN's bf16 linear rounds)."""
    if isinstance(panels, tuple):  # coded panels (codes, scales, lows): fp32 weights rebuilt on the core
        codes = panels[0]
        out = np.empty((x.shape[0], codes.shape[0] * PANEL), dtype=np.float32)  # [M, P x PANEL]
        coded_kernels[8 if codes.dtype == np.int8 else 4]()(x.float().contiguous().numpy(), *panels, out)
    elif panels.ndim == 3 and panels.dtype == np.uint32:  # bf16 pair panels: the CPU's bf16 dot product
        if bias is None and dtype == torch.bfloat16 and panels.shape[0] * PANEL == out_features:
            return torch.from_numpy(bf16_dot.matmul(x.to(torch.bfloat16), panels, rounded=True)).view(torch.bfloat16)
        out = bf16_dot.matmul(x.to(torch.bfloat16), panels)
    else:
        out = np.empty((x.shape[0], panels.shape[0] * PANEL), dtype=np.float32)  # [M, P x PANEL]
        kernels[dtype]()(x.float().contiguous().numpy(), panels, out)
    result = torch.from_numpy(out)  # numpy <-> torch here share memory: no copies, a few microseconds a call
    if out.shape[1] != out_features:
        result = result[:, :out_features].contiguous()
    if bias is not None:
        result.add_(bias)
    return result if dtype == torch.float32 else result.to(dtype)


class PanelLinear(torch.nn.Module):
    """An fp32 or bf16 nn.Linear whose weight lives as panels (the only copy) and runs through the panel kernel, or
    for bf16 on a CPU with AVX512_BF16, through its dot-product instruction (bf16_dot.py)."""

    def __init__(self, source: torch.nn.Linear | None = None, panels: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, out_features: int = 0, in_features: int = 0):
        """From an nn.Linear, or from panels already cut (a stack of two layers')."""
        super().__init__()
        if source is not None:
            weight, bias = source.weight.detach(), source.bias
            out_features, in_features = source.out_features, source.in_features
            pairs = weight.dtype == torch.bfloat16 and bf16_dot.available()
            panels = bf16_dot.to_pair_panels(weight) if pairs else coded(weight) or to_panels(weight)
        if panels.dim() == 4 and not in_features:
            raise ValueError("bf16 pair panels hold half the input width: give in_features")
        self.in_features, self.out_features = in_features or panels.shape[1], out_features
        self.panels = panels  # [P, in, PANEL], bf16 pair panels [P, in / 2, PANEL, 2], or coded fp32 panels
        self.panels_array = as_kernel_array(panels)  # the same memory, as the kernel takes it
        self.bias = None if bias is None else bias.detach().float()  # added to the fp32 sums

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], a dense copy (for the few readers of single rows: the attention probe, a subset head)."""
        if self.panels.dim() == 4:
            return bf16_dot.dense_weight(self.panels, self.out_features, self.in_features)
        if isinstance(self.panels, coded_panels.CodedPanels):
            return self.panels.dense()[: self.out_features]
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return linear(x, self.panels_array, self.bias, self.out_features, self.panels.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out = self.project(x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)


def stack(*modules: PanelLinear) -> PanelLinear | None:
    """One PanelLinear computing [m(x) for m in modules] in one call (gate and up; q, k and v), or None when they
    cannot share one.

    The modules' panels become views into the stacked ones, so the weights stay a single copy and each module
    still computes alone (Hugging Face's modules, the attention probe)."""
    first = modules[0]
    columns = PANEL * (bf16_dot.WIDTH if first.panels.dim() == 4 else 1)  # each one's panels end where it does
    if any(m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
           or m.panels.shape[1:] != first.panels.shape[1:] or m.panels.dtype != first.panels.dtype
           or _layout(m.panels) != _layout(first.panels) for m in modules) or any(
            m.out_features % columns for m in modules[:-1]):
        return None
    coded = isinstance(first.panels, coded_panels.CodedPanels)
    panels = coded_panels.concat([m.panels for m in modules]) if coded else torch.cat([m.panels for m in modules])
    stacked = PanelLinear(panels=panels,  # [P1 + P2 + ..., ...]
                          bias=None if first.bias is None else torch.cat([m.bias for m in modules]),
                          out_features=sum(m.out_features for m in modules), in_features=first.in_features)
    start = 0
    for module in modules:
        part = stacked.panels[start:start + module.panels.shape[0]]  # a contiguous view along the first dim
        module.panels, module.panels_array = part, as_kernel_array(part)
        start += part.shape[0]
    return stacked


def _layout(panels) -> object:
    """What must agree for panels to share one kernel call: dense, or coded with that many bits."""
    return panels.bits if isinstance(panels, coded_panels.CodedPanels) else "dense"


CODED_ENV = "SPECBATCH_CODED_WEIGHTS"  # "0": fp32 weights stay fp32 panels even where they are exact codes


def coded(weight: torch.Tensor) -> coded_panels.CodedPanels | None:
    """An fp32 weight [out, in] as coded panels where it is exact block codes and their kernel compiles (unless
    CODED_ENV=0), else None."""
    if os.environ.get(CODED_ENV, "1") == "0" or weight.dtype != torch.float32:
        return None
    panels = coded_panels.encode(weight)
    return panels if panels is not None and coded_kernels[panels.bits]() is not None else None


def panel_linears(module: torch.nn.Module, dtypes=(torch.float32,)) -> int:
    """Every nn.Linear of one of `dtypes` under `module` becomes a PanelLinear, in place; returns how many."""
    return replace_linears(module, PanelLinear, dtypes)
