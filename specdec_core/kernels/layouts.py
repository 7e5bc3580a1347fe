"""The constants a kernel and its wrapper share: the wrapper packs weights and sizes buffers by them at load time,
the kernel compiles them in. They live here, in a file that imports neither numba nor torch, so each wrapper can
import them without loading numba and no kernel imports its wrapper."""

# bf16_dot: packed weights [P, ceil(in / 2), DOT_PANEL, 2], P a multiple of DOT_WIDTH
DOT_PANEL = 16  # columns per panel: one vector of 16 fp32 sums
DOT_WIDTH = 2  # panels a task computes together
DOT_ROWS = 8  # rows a task computes together
DOT_NARROW_ROWS = (13, 16)  # row counts that one pass over each panel alone computes, all rows at once
DOT_FEW_ROWS = 8  # up to this many rows (a small batch's decode step), too: one pass over each panel alone
DOT_ROW_BLOCK = 1024  # the most rows of x per task: each task streams its panels once for all of them
DOT_INTRINSIC = "llvm.x86.avx512bf16.dpbf16ps.512"

# rope_store
ROPE_PARALLEL_CHUNKS = 16  # token ranges of the parallel kernel (a few per thread)

# bf16_attention: a task is up to this many new tokens of one row and key/value head
BF16_ATTENTION_QUERY_BLOCK = 32

# bf16_step_attention
STEP_PASS_ROWS = 4  # query rows per pass over a row's keys (head_dim 64; 2 for 128): their sums stay in registers

# invariant_attention
INVARIANT_QUERY_BLOCK = 64  # new tokens of a row per task: the keys they see are widened / copied once for all of them
