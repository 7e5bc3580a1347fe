"""The compiled kernel of bf16_dot.py, at module level so numba's disk cache finds it again in the next process (a
function defined inside another, calling intrinsics it closes over, got a new cache key in every process). Imported
only when the kernel is first used: it imports numba and llvmlite. `_rows_kernel` builds one loop's LLVM IR in one
function (~70 lines, over the ~50 the codebase keeps to): the body's phis, loads and stores refer to each other."""

from functools import lru_cache

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .layouts import (DOT_FEW_ROWS as FEW_ROWS, DOT_INTRINSIC as INTRINSIC, DOT_NARROW_ROWS as NARROW_ROWS,
                      DOT_PANEL as PANEL, DOT_ROW_BLOCK as ROW_BLOCK, DOT_ROWS as ROWS, DOT_WIDTH as WIDTH)

# k-steps (64-byte lines of a panel) to prefetch ahead. At 16 rows the kernel computes about as fast as memory
# streams the weights, and without it did one after the other (decisions.md: specdec_core/kernels/bf16_dot_kernel.py).
PREFETCH = 32
TO_BF16 = "llvm.x86.avx512bf16.cvtneps2bf16.512"


@lru_cache(maxsize=1)
def _bfloat():
    """LLVM's bfloat type, which llvmlite's IR builder has no name for (one class: declarations compare types)."""

    class BFloat(ir.Type):
        def _to_string(self):
            return "bfloat"

        def __eq__(self, other):
            return isinstance(other, BFloat)

        def __hash__(self):
            return hash("bfloat")

    return BFloat()


def prefetch(builder, pointer) -> None:
    """A read prefetch of the cache line at `pointer` into all cache levels."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                              "llvm.prefetch.p0")
    builder.call(function, [builder.bitcast(pointer, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                            ir.Constant(i32, 1)])


def _rows_kernel(rows: int, width: int):
    """A numba intrinsic: out[m : m + rows, p x 16 : (p + width) x 16] = x[m : m + rows] @ panels[p : p + width],
    with x uint32 [M, K2] (bf16 pairs), panels uint32 [P, >= K2, 16] (the first K2 pairs of each panel are read),
    out float32 [M, P x 16] (the sums), or uint16 (the sums rounded to bf16 by the CPU's vcvtneps2bf16: nearest
    even, as torch rounds, but fp32 denormals become zero)."""
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
        # a panel's words from the array's stride, not from K2: the attention's panels may hold more pairs than x
        panel_words = builder.udiv(builder.extract_value(panels.strides, 0), constant(4))
        panel_starts = [builder.gep(panels.data, [builder.mul(builder.add(first_panel, constant(w)), panel_words)])
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
        for start in panel_starts:  # a panel's later cache lines while this one computes (prefetch never faults)
            prefetch(builder, builder.gep(start, [builder.mul(builder.add(k, constant(PREFETCH)), constant(PANEL))]))
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
        rounded = isinstance(signature.args[4].dtype, types.Integer)  # uint16 out: bf16 bits, rounded here
        convert = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VectorType(_bfloat(), PANEL), [floats]), TO_BF16) if rounded else None
        for (r, w), value in updated.items():
            place = builder.add(builder.mul(builder.add(first_row, constant(r)), columns),
                                builder.mul(builder.add(first_panel, constant(w)), constant(PANEL)))
            if rounded:
                halves = ir.VectorType(ir.IntType(16), PANEL)
                builder.store(builder.bitcast(builder.call(convert, [value]), halves),
                              builder.bitcast(builder.gep(out.data, [place]), halves.as_pointer()), align=2)
            else:
                builder.store(value, builder.bitcast(builder.gep(out.data, [place]), floats.as_pointer()), align=4)
        return context.get_dummy_value()

    @intrinsic
    def rows_kernel(typingctx, x, first_row, panels, first_panel, out):
        return types.void(x, first_row, panels, first_panel, out), codegen

    return rows_kernel


held_rows, one_row = _rows_kernel(ROWS, WIDTH), _rows_kernel(1, WIDTH)
# The rows left over after the blocks of 8, all in one pass: one row at a time, each pass streaming the panels again
# with 2 accumulators, was latency-bound.
rows_2, rows_3, rows_4, rows_5 = (_rows_kernel(n, WIDTH) for n in (2, 3, 4, 5))
rows_6, rows_7 = _rows_kernel(6, WIDTH), _rows_kernel(7, WIDTH)


@njit(cache=True)
def rest_rows(x, first, count, panels, p, out):  # pragma: no cover - compiled
    """Rows first .. first + count - 1 (count < ROWS) of x @ panels[p : p + WIDTH] in one pass: every row runs the
    same instruction sequence as in a block of 8 or alone."""
    if count == 1:
        one_row(x, first, panels, p, out)
    elif count == 2:
        rows_2(x, first, panels, p, out)
    elif count == 3:
        rows_3(x, first, panels, p, out)
    elif count == 4:
        rows_4(x, first, panels, p, out)
    elif count == 5:
        rows_5(x, first, panels, p, out)
    elif count == 6:
        rows_6(x, first, panels, p, out)
    elif count == 7:
        rows_7(x, first, panels, p, out)


# 13 to 16 rows in one pass over each panel alone (up to 16 sums held): a block of 8 and the rest passed over each
# pair of panels twice, the first pass streaming it from memory. Faster so with the weights streamed; 12 rows were not
# (decisions.md: specdec_core/kernels/bf16_dot_kernel.py). Each row's sums run the same instructions either way.
narrow_13, narrow_14, narrow_15, narrow_16 = (_rows_kernel(n, 1) for n in (13, 14, 15, 16))


# 1 to 8 rows (a small batch's decode or verify step) likewise: the weights stream from memory, and a task reading one
# panel is one stream; pairs of panels ran 30 layers' linears at 4-8 rows 5-12 % slower (decisions.md:
# specdec_core/kernels/bf16_dot_kernel.py).
few_1, few_2, few_3, few_4 = (_rows_kernel(n, 1) for n in (1, 2, 3, 4))
few_5, few_6, few_7, few_8 = (_rows_kernel(n, 1) for n in (5, 6, 7, 8))


@njit(cache=True)
def narrow_rows(x, count, panels, p, out):  # pragma: no cover - compiled
    """All `count` rows (1 <= count <= FEW_ROWS, or NARROW_ROWS[0] <= count <= NARROW_ROWS[1]) of x @ panels[p] in
    one pass."""
    if count == 1:
        few_1(x, 0, panels, p, out)
    elif count == 2:
        few_2(x, 0, panels, p, out)
    elif count == 3:
        few_3(x, 0, panels, p, out)
    elif count == 4:
        few_4(x, 0, panels, p, out)
    elif count == 5:
        few_5(x, 0, panels, p, out)
    elif count == 6:
        few_6(x, 0, panels, p, out)
    elif count == 7:
        few_7(x, 0, panels, p, out)
    elif count == 8:
        few_8(x, 0, panels, p, out)
    elif count == 13:
        narrow_13(x, 0, panels, p, out)
    elif count == 14:
        narrow_14(x, 0, panels, p, out)
    elif count == 15:
        narrow_15(x, 0, panels, p, out)
    else:
        narrow_16(x, 0, panels, p, out)


@njit(parallel=True, cache=True)
def matmul(x, panels, out):  # pragma: no cover - compiled
    """x uint32 [M, K2]; panels uint32 [P, K2, 16] (P a multiple of WIDTH); out float32 or uint16 (bf16 bits)
    [M, P x 16]."""
    rows = x.shape[0]
    if 1 <= rows <= FEW_ROWS or NARROW_ROWS[0] <= rows <= NARROW_ROWS[1]:
        for p in prange(panels.shape[0]):
            narrow_rows(x, rows, panels, p, out)
        return
    count = panels.shape[0] // WIDTH
    blocks = max(1, (rows + ROW_BLOCK - 1) // ROW_BLOCK)  # one empty block for no rows
    size = ((rows + blocks - 1) // blocks + ROWS - 1) // ROWS * ROWS  # equal blocks: no thread waits on a short one
    for task in prange(blocks * count):
        p = (task % count) * WIDTH
        first = (task // count) * size
        last = min(rows, first + size)
        held = first + (last - first) // ROWS * ROWS
        for m in range(first, held, ROWS):
            held_rows(x, m, panels, p, out)
        if held < last:
            rest_rows(x, held, last - held, panels, p, out)
