"""The compiled kernel of amx_linear.py, at module level so numba's disk cache finds it again in the next process.
Imported only when the kernel is first used: it imports numba and llvmlite.

Tile registers: tmm0..tmm3 hold the [16 rows x 16 columns] fp32 sums of four strips of the output, tmm4 the input
rows' 32 values of a chunk, tmm5/tmm6 the weights' tiles in turn."""

import numpy as np
from numba import njit, prange

from . import amx_tiles as tiles

STRIPS = 4  # output strips of 16 columns a task computes together (its four accumulator tiles)
TILE_BYTES = 1024


@njit(cache=True, inline="always")
def _round_out(sums, out, first_row, first_column, columns):  # pragma: no cover - compiled
    """sums [16, >= columns] fp32 -> out[first_row .. + 16, first_column .. + columns] as bf16 bits (columns 64 or
    32: whole 64-byte halves of the tile rows)."""
    source, target = tiles.address(sums), tiles.address(out) + (first_row * out.shape[1] + first_column) * 2
    for r in range(tiles.ROWS):
        if columns == 64:
            tiles.round_64(source + r * 256, target + r * out.shape[1] * 2)
        else:
            tiles.round_32(source + r * 256, target + r * out.shape[1] * 2)


@njit(parallel=True, cache=True)
def linear(x, w, out):  # pragma: no cover - compiled
    """x uint16 [16 B, 32 C] bf16 bits; w uint32 [S, C, 16, 16] (amx_linear.pack: strip s's chunk c as a tile of
    pairs), S a multiple of STRIPS; out uint16 [16 B, 16 S] bf16 bits = x . W^T, each sum rounded to nearest even.
    One block of 16 rows: a task is STRIPS strips, each weight tile read once. More blocks: a task is two strips,
    and two blocks at a time share each weight tile read (the four accumulators as 2 x 2)."""
    strips, chunks = w.shape[0], w.shape[1]
    config = tiles.config()
    blocks = x.shape[0] // tiles.ROWS
    row_bytes = x.shape[1] * 2
    if blocks == 1:
        for group in prange(strips // STRIPS):
            tiles.configure(tiles.address(config))
            sums = np.empty((tiles.ROWS, STRIPS * 16), dtype=np.float32)
            at, base, rows = tiles.address(sums), tiles.address(w) + group * STRIPS * chunks * TILE_BYTES, tiles.address(x)
            tiles.zero_sums()
            for c in range(chunks):
                tiles.load4(rows + c * 64, row_bytes)
                tiles.load5(base + c * TILE_BYTES, 64)
                tiles.dot_0_4_5()
                tiles.load6(base + (chunks + c) * TILE_BYTES, 64)
                tiles.dot_1_4_6()
                tiles.load5(base + (2 * chunks + c) * TILE_BYTES, 64)
                tiles.dot_2_4_5()
                tiles.load6(base + (3 * chunks + c) * TILE_BYTES, 64)
                tiles.dot_3_4_6()
            tiles.store0(at, 256)
            tiles.store1(at + 64, 256)
            tiles.store2(at + 128, 256)
            tiles.store3(at + 192, 256)
            _round_out(sums, out, 0, group * STRIPS * 16, 64)
            tiles.release()
        return
    for group in prange(strips // 2):
        tiles.configure(tiles.address(config))
        sums = np.empty((2, tiles.ROWS, 64), dtype=np.float32)  # per block: the two strips' columns
        at, base = tiles.address(sums), tiles.address(w) + group * 2 * chunks * TILE_BYTES
        for pair in range(0, blocks, 2):
            second = min(pair + 1, blocks - 1)  # an odd last block pairs with itself
            first_rows = tiles.address(x) + pair * tiles.ROWS * row_bytes
            second_rows = tiles.address(x) + second * tiles.ROWS * row_bytes
            tiles.zero_sums()
            for c in range(chunks):
                tiles.load4(first_rows + c * 64, row_bytes)
                tiles.load5(second_rows + c * 64, row_bytes)
                tiles.load6(base + c * TILE_BYTES, 64)
                tiles.load7(base + (chunks + c) * TILE_BYTES, 64)
                tiles.dot_0_4_6()
                tiles.dot_1_4_7()
                tiles.dot_2_5_6()
                tiles.dot_3_5_7()
            tiles.store0(at, 256)
            tiles.store1(at + 64, 256)
            tiles.store2(at + tiles.ROWS * 256, 256)
            tiles.store3(at + tiles.ROWS * 256 + 64, 256)
            _round_out(sums[0], out, pair * tiles.ROWS, group * 32, 32)
            if second != pair:
                _round_out(sums[1], out, second * tiles.ROWS, group * 32, 32)
        tiles.release()
