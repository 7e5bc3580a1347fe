"""AMX tile instructions inside numba kernels, as inline assembly: numba and LLVM's IR builder have no tile types, so
each instruction is one asm statement on fixed tile registers (tmm0..tmm7), which the compiler never allocates.
Imported by the compiled AMX kernels only: it imports numba and llvmlite.

A kernel loads a tile configuration (`configure`) before its first tile instruction on a thread and releases the
tiles (`release`) when done; every tile here is 16 rows of 64 bytes (16 fp32, or 32 bf16, a row)."""

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot_kernel import TO_BF16, _bfloat

binding.initialize_native_asmparser()  # numba's JIT parses no inline assembly without it

I64 = ir.IntType(64)
ROWS, ROW_BYTES = 16, 64


@njit(cache=True, inline="always")
def address(array):  # pragma: no cover - compiled
    """An array's data address as int64 (numba's is unsigned, and unsigned + signed arithmetic turns float)."""
    return np.int64(array.ctypes.data)


@njit(cache=True)
def config():  # pragma: no cover - compiled
    """The 64-byte tile configuration of palette 1 with every tile ROWS x ROW_BYTES (for `configure`)."""
    data = np.zeros(64, dtype=np.uint8)
    data[0] = 1  # palette 1
    for tile in range(8):
        data[16 + 2 * tile] = ROW_BYTES  # bytes a row (little-endian uint16: the high byte stays 0)
        data[48 + tile] = ROWS
    return data


def _asm(text: str, arity: int):
    """An intrinsic running `text` with `arity` integer operands ($0.. as 64-bit registers), ordered with memory."""
    constraint = ",".join(["r"] * arity + ["~{memory}"])

    def typed(operands):
        if not all(isinstance(t, types.Integer) for t in operands):
            return None

        def codegen(context, builder, signature, args):
            values = [context.cast(builder, a, t, types.int64) for a, t in zip(args, signature.args)]
            builder.asm(ir.FunctionType(ir.VoidType(), [I64] * arity), text, constraint, values, side_effect=True)
            return context.get_dummy_value()

        return types.void(*operands), codegen

    # numba types an intrinsic by its parameters: one fixed list per arity (no *args)
    if arity == 0:
        def typer(typingctx):
            return typed(())
    elif arity == 1:
        def typer(typingctx, address):
            return typed((address,))
    else:
        def typer(typingctx, address, stride):
            return typed((address, stride))
    return intrinsic(typer)


configure = _asm("ldtilecfg ($0)", 1)  # (address of config())
release = _asm("tilerelease", 0)


def _dot(c: int, a: int, b: int):
    """tmm_c [16 x 16 fp32] += tmm_a [16 x 32 bf16] . tmm_b [16 pairs x 16 x 2 bf16] (b's rows hold pairs of
    consecutive rows of the right-hand matrix, interleaved: "VNNI" layout)."""
    return _asm(f"tdpbf16ps %tmm{b}, %tmm{a}, %tmm{c}", 0)


# The tile registers the kernels use: tmm0..tmm3 accumulate, tmm4..tmm7 hold operands (amx_*_kernel.py).
zero0, zero1, zero2, zero3 = (_asm(f"tilezero %tmm{t}", 0) for t in range(4))
load4, load5, load6, load7 = (_asm(f"tileloadd ($0,$1,1), %tmm{t}", 2) for t in range(4, 8))  # (address, row bytes)
store0, store1, store2, store3 = (_asm(f"tilestored %tmm{t}, ($0,$1,1)", 2) for t in range(4))  # (address, row bytes)
# dot_C_A_B: tmm_C += tmm_A . tmm_B
dot_0_4_5, dot_1_4_5, dot_2_4_5, dot_3_4_5 = (_dot(c, 4, 5) for c in range(4))
dot_0_4_6, dot_1_4_6, dot_3_4_6, dot_0_5_7 = _dot(0, 4, 6), _dot(1, 4, 6), _dot(3, 4, 6), _dot(0, 5, 7)
dot_1_4_7, dot_2_5_6, dot_3_5_7 = _dot(1, 4, 7), _dot(2, 5, 6), _dot(3, 5, 7)


@njit(cache=True, inline="always")
def zero_sums():  # pragma: no cover - compiled
    """The four accumulator tiles (tmm0..tmm3) <- 0."""
    zero0()
    zero1()
    zero2()
    zero3()


@intrinsic
def pair_rows(typingctx, low, high, out):
    """Two rows of 64 bf16 values (at addresses low, high) -> 4 tile rows of 16 pairs (at out + 1024 k, k = 0..3):
    row k interleaves dims 16k..16k + 15 of low and high, as a tile's pairs of consecutive keys (amx "VNNI")."""
    if not all(isinstance(t, types.Integer) for t in (low, high, out)):
        return None
    halves = ir.VectorType(ir.IntType(16), 32)
    i32 = ir.IntType(32)

    def codegen(context, builder, signature, args):
        low_at, high_at, out_at = (context.cast(builder, a, t, types.int64) for a, t in zip(args, signature.args))

        def at(address, offset, kind):
            return builder.inttoptr(builder.add(address, ir.Constant(I64, offset)), kind.as_pointer())

        rows = [[builder.load(at(address, 64 * v, halves), align=2) for v in (0, 1)] for address in (low_at, high_at)]
        for k in range(4):
            v, start = k // 2, 16 * (k % 2)
            mask = [start + d // 2 + (32 if d % 2 else 0) for d in range(32)]  # low d, high d, low d + 1, ...
            pairs = builder.shuffle_vector(rows[0][v], rows[1][v], ir.Constant(ir.VectorType(i32, 32), mask))
            builder.store(pairs, at(out_at, 1024 * k, halves), align=4)
        return context.get_dummy_value()

    return types.void(low, high, out), codegen


@intrinsic
def transpose_out(typingctx, source, target, row_bytes):
    """A [16 x 16] fp32 tile at `source` (rows 64 bytes apart) -> its transpose, row c at target + c x row_bytes:
    four rounds of two-source shuffles, each swapping one bit of the row index with the column's."""
    if not all(isinstance(t, types.Integer) for t in (source, target, row_bytes)):
        return None
    floats = ir.VectorType(ir.FloatType(), 16)
    i32 = ir.IntType(32)

    def codegen(context, builder, signature, args):
        source_at, target_at, stride = (context.cast(builder, a, t, types.int64)
                                        for a, t in zip(args, signature.args))
        rows = [builder.load(builder.inttoptr(builder.add(source_at, ir.Constant(I64, 64 * r)), floats.as_pointer()),
                             align=4) for r in range(16)]
        for bit in (1, 2, 4, 8):
            low_mask = [c if not c & bit else 16 + (c ^ bit) for c in range(16)]
            high_mask = [c | bit if not c & bit else 16 + c for c in range(16)]
            swapped = list(rows)
            for r in range(16):
                if not r & bit:
                    a, b = rows[r], rows[r | bit]
                    swapped[r] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 16), low_mask))
                    swapped[r | bit] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 16), high_mask))
            rows = swapped
        for c in range(16):
            place = builder.add(target_at, builder.mul(stride, ir.Constant(I64, c)))
            builder.store(rows[c], builder.inttoptr(place, floats.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(source, target, row_bytes), codegen


@intrinsic
def prefetch(typingctx, address, lines):
    """Ask for `lines` cache lines from `address` on (llvm.prefetch, for reading, into every cache level)."""
    if not all(isinstance(t, types.Integer) for t in (address, lines)):
        return None

    def codegen(context, builder, signature, args):
        start = context.cast(builder, args[0], signature.args[0], types.int64)
        count = context.cast(builder, args[1], signature.args[1], types.int64)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                               "llvm.prefetch.p0")
        with cgutils.for_range(builder, count) as loop:
            place = builder.add(start, builder.mul(loop.index, ir.Constant(I64, 64)))
            builder.call(fetch, [builder.inttoptr(place, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                                 ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(address, lines), codegen


def _rounding(vectors: int):
    """An intrinsic: 16 x `vectors` fp32 at `source` -> their bf16 bits at `target`, rounded to nearest even
    (vcvtneps2bf16, as torch rounds; AMX CPUs all have AVX512_BF16)."""
    floats, halves = ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.IntType(16), 16)

    def typer(typingctx, source, target):
        if not all(isinstance(t, types.Integer) for t in (source, target)):
            return None

        def codegen(context, builder, signature, args):
            source_at, target_at = (context.cast(builder, a, t, types.int64) for a, t in zip(args, signature.args))
            convert = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VectorType(_bfloat(), 16),
                                                                                      [floats]), TO_BF16)
            for v in range(vectors):
                value = builder.load(builder.inttoptr(builder.add(source_at, ir.Constant(I64, 64 * v)),
                                                      floats.as_pointer()), align=4)
                rounded = builder.bitcast(builder.call(convert, [value]), halves)
                builder.store(rounded, builder.inttoptr(builder.add(target_at, ir.Constant(I64, 32 * v)),
                                                        halves.as_pointer()), align=2)
            return context.get_dummy_value()

        return types.void(source, target), codegen

    return intrinsic(typer)


round_64, round_32 = _rounding(4), _rounding(2)  # (source, target): 64 or 32 fp32 -> bf16 bits
