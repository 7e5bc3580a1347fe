"""bf16 linear layers on CPUs with AVX512_BF16, through the CPU's bf16 dot-product instruction (vdpbf16ps).

Why: oneDNN's bf16 linear is not row-invariant (a row of SmolLM2's down projection, [M, 1536] x [1536, 576],
changed from M = 14 rows on an AMD avx512_bf16 CPU), which --deterministic needs; the widening panel kernel
(panel_linear.py's bf16 fallback) is, but computes in fp32 FMAs at half the rate: 0.3-0.7x oneDNN from 16 rows up.
This kernel uses the instruction oneDNN uses, in one fixed order for every row, and on that CPU beat oneDNN at every
row count measured (30 layers of SmolLM2's shapes: 2x at 1 row, 1.5x at 16, 1.35x at 64, 1.07x at 256).

What is guaranteed: out[m, n] = bias[n] + the fp32 accumulation, over k-pairs (0, 1), (2, 3), ... in that order, of
vdpbf16ps(x[m, 2i : 2i + 2], w[n, 2i : 2i + 2]) (the instruction adds both products to the lane, with its own fixed
rounding), the same instruction sequence for every row, whether it is computed with 7 other rows or alone. A row's
numbers therefore depend on that row alone (tests/specdec_core/test_panel_linear.py checks it bitwise).

Layout: the weight [out, in] is cut into 16-column panels of k-pairs, [P, in / 2, 16, 2] bf16: the 64 bytes one
instruction reads. A task holds 8 rows x 2 panels (16 vector accumulators) while it walks k: fewer rows or columns
leave the instruction's latency exposed, more spill registers (measured: 4x1 0.5x, 8x2 1.5x oneDNN at 16 rows).

numba has no vector types, so the k loop is written as LLVM IR (`_rows_kernel`), called from a numba loop over
(row block, panel pair); compiled once per machine, cached under $SPECBATCH_CACHE/numba.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .numba_kernels import LazyKernel, use_torch_threads

PANEL = 16  # columns per panel: one vector of 16 fp32 sums
WIDTH = 2  # panels a task computes together
ROWS = 8  # rows a task computes together
ROW_BLOCK = 128  # rows of x per task, so a long prefill's rows stay in L2 while every panel passes over them
INTRINSIC = "llvm.x86.avx512bf16.dpbf16ps.512"


@lru_cache(maxsize=1)
def _bfloat():
    """LLVM's bfloat type, which llvmlite's IR builder has no name for (one class: declarations compare types)."""
    from llvmlite import ir

    class BFloat(ir.Type):
        def _to_string(self):
            return "bfloat"

        def __eq__(self, other):
            return isinstance(other, BFloat)

        def __hash__(self):
            return hash("bfloat")

    return BFloat()


def _rows_kernel(rows: int, width: int):
    """A numba intrinsic: out[m : m + rows, p x 16 : (p + width) x 16] = x[m : m + rows] @ panels[p : p + width],
    with x uint32 [M, K2] (bf16 pairs), panels uint32 [P, K2, 16], out float32 [M, P x 16]."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    floats, words, pairs = ir.VectorType(f32, PANEL), ir.VectorType(i32, PANEL), ir.VectorType(_bfloat(), 2 * PANEL)

    def constant(value):
        return ir.Constant(i64, value)

    def codegen(context, builder, signature, args):
        x, panels, out = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4))
        first_row, first_panel = args[1], args[3]
        depth = builder.extract_value(x.shape, 1)  # K2
        columns = builder.extract_value(out.shape, 1)
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats, pairs, pairs]), INTRINSIC)
        x_rows = builder.gep(x.data, [builder.mul(first_row, depth)])
        panel_starts = [builder.gep(panels.data, [builder.mul(builder.add(first_panel, constant(w)),
                                                              builder.mul(depth, constant(PANEL)))])
                        for w in range(width)]
        entry, loop, done = builder.block, builder.append_basic_block("k"), builder.append_basic_block("done")
        builder.branch(loop)
        builder.position_at_end(loop)
        k = builder.phi(i64)
        k.add_incoming(constant(0), entry)
        sums = {}
        for key in ((r, w) for r in range(rows) for w in range(width)):
            sums[key] = builder.phi(floats)
            sums[key].add_incoming(ir.Constant(floats, None), entry)
        weights = [builder.bitcast(builder.load(builder.bitcast(builder.gep(start, [builder.mul(k, constant(PANEL))]),
                                                                words.as_pointer()), align=4), pairs)
                   for start in panel_starts]
        updated = {}
        for r in range(rows):
            pair = builder.load(builder.gep(x_rows, [builder.add(builder.mul(constant(r), depth), k)]))
            spread = builder.insert_element(ir.Constant(words, None), pair, ir.Constant(i32, 0))
            spread = builder.bitcast(builder.shuffle_vector(spread, ir.Constant(words, None),
                                                            ir.Constant(words, [0] * PANEL)), pairs)
            for w in range(width):
                updated[r, w] = builder.call(dot, [sums[r, w], weights[w], spread])
        following = builder.add(k, constant(1))
        k.add_incoming(following, loop)
        for key, phi in sums.items():
            phi.add_incoming(updated[key], loop)
        builder.cbranch(builder.icmp_unsigned("<", following, depth), loop, done)
        builder.position_at_end(done)
        for (r, w), value in updated.items():
            place = builder.add(builder.mul(builder.add(first_row, constant(r)), columns),
                                builder.mul(builder.add(first_panel, constant(w)), constant(PANEL)))
            builder.store(value, builder.bitcast(builder.gep(out.data, [place]), floats.as_pointer()), align=4)
        return context.get_dummy_value()

    @intrinsic
    def rows_kernel(typingctx, x, first_row, panels, first_panel, out):
        return types.void(x, first_row, panels, first_panel, out), codegen

    return rows_kernel


def _compile():
    from numba import njit, prange

    held_rows, one_row = _rows_kernel(ROWS, WIDTH), _rows_kernel(1, WIDTH)

    @njit(parallel=True, cache=True)
    def matmul(x, panels, out):  # pragma: no cover - compiled
        """x uint32 [M, K2]; panels uint32 [P, K2, 16] (P a multiple of WIDTH); out float32 [M, P x 16]."""
        rows = x.shape[0]
        count = panels.shape[0] // WIDTH
        blocks = (rows + ROW_BLOCK - 1) // ROW_BLOCK
        for task in prange(blocks * count):
            p = (task % count) * WIDTH
            first = (task // count) * ROW_BLOCK
            last = min(rows, first + ROW_BLOCK)
            held = first + (last - first) // ROWS * ROWS
            for m in range(first, held, ROWS):
                held_rows(x, m, panels, p, out)
            for m in range(held, last):  # the rows left over: the same instructions, one row at a time
                one_row(x, m, panels, p, out)

    use_torch_threads()
    matmul.compile("(uint32[:, ::1], uint32[:, :, ::1], float32[:, ::1])")
    return matmul


kernel = LazyKernel(_compile, "the bf16 dot-product linear kernel", "; bf16 linears widen to fp32 instead")


def available() -> bool:
    """Whether bf16 linears run through this kernel here: a CPU with AVX512_BF16 (asked first, so other CPUs
    neither compile it nor log about it) and numba able to compile it."""
    return torch.cpu._is_avx512_bf16_supported() and kernel() is not None


def to_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> [P, ceil(in / 2), 16, 2] bf16, P a multiple of WIDTH; missing columns and the odd input
    column are zeros."""
    out_features, in_features = weight.shape
    count = -(-out_features // (PANEL * WIDTH)) * WIDTH
    depth = -(-in_features // 2)
    padded = weight.new_zeros(count * PANEL, 2 * depth)
    padded[:out_features, :in_features] = weight
    return padded.view(count, PANEL, depth, 2).transpose(1, 2).contiguous()  # one copy


def dense_weight(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of to_pair_panels: [out, in], a copy."""
    count, depth = panels.shape[0], panels.shape[1]
    return panels.transpose(1, 2).reshape(count * PANEL, 2 * depth)[:out_features, :in_features]


def as_words(panels: torch.Tensor) -> np.ndarray:
    """[P, K2, 16, 2] bf16 -> the same memory as uint32 [P, K2, 16], as the kernel reads it."""
    return panels.view(torch.int32).numpy().view(np.uint32).reshape(panels.shape[:3])


def matmul(x: torch.Tensor, panels: np.ndarray) -> np.ndarray:
    """[M, in] bf16 x pair panels (as_words) -> [M, P x 16] float32 sums."""
    depth = panels.shape[1]
    if x.shape[1] != 2 * depth:  # an odd input width: one zero column, as the panels have
        x = torch.nn.functional.pad(x, (0, 2 * depth - x.shape[1]))
    words = x.contiguous().view(torch.int32).numpy().view(np.uint32)  # [M, K2]
    out = np.empty((x.shape[0], panels.shape[0] * PANEL), dtype=np.float32)
    kernel()(words, panels, out)
    return out
