"""Attention of a long fp32 forward (a prefill chunk) on a CPU: each row over its own keys only, both products as
register-blocked panel products, without a mask.

Why: PyTorch's CPU SDPA (flash attention for CPU) was the largest part of an fp32 prefill after the linears, at
well under the rate of a matmul on the same CPU. A prompt's later chunks carried a [b, T, L] float mask, with which
SDPA computes every masked score, and GQA went through copies of the keys and values, one per query head. This
kernel ran a SmolLM2 layer's prompt attention faster on the AVX2 class (decisions.md: "A prefill attention of our
own", session 35).

How: a task is up to QUERY_BLOCK new tokens of one row and key/value head. The keys its last token sees are repacked
into 16-key panels ([keys / 16, d, 16], once a forward for all of a row's blocks); the scores of the group's query
heads come from one product over those panels, 4 query rows x 16 keys of sums held in registers (the panel
linears' loop, panel_linear.py, generated the same way). The softmax runs in fp32 over each token's own keys (its
cached ones and the new tokens up to itself); the weighted sum is a second panel product over the values as they
lie in the cache (16 dimensions a panel), where a token's unseen keys add exact zeros.

A token's result depends on its own query and keys only: each score is a fixed-order sum over head_dim, the softmax
covers exactly the keys it sees, and the weighted sum walks the keys from position 0 in order. Not the block, the
chunking, a prefix hit or the other rows: a prompt's keys and values come out the same however it is fed.

Chains only (each new token sees the ones before it): a prefill, or a verify of a long chain draft. Trees keep SDPA.
Compiled by numba once per machine (the module is generated, written and cached under $SPECBATCH_CACHE/numba).
"""

from __future__ import annotations

import numpy as np
import torch

from .numba_kernels import LazyKernel, load_generated, slp_vectorized, use_torch_threads

PANEL = 16  # keys (scores) or head dimensions (weighted sums) a panel: two AVX registers of fp32
QUERY_BLOCK = 64  # new tokens a task: their keys are repacked once for every block of the row
MODULE_NAME = "specbatch_fp32_chain_attention"


def _product_lines(name: str, rows: int, load: str) -> list[str]:
    """The source of `name`(x, m, w, p, depth, out): out[m + i, 16p + j] = sum over k < depth of x[m + i, k] x
    `load`(k, j), for i < rows and j < 16, in order of k; the 16 x rows sums are scalars that LLVM's SLP vectoriser
    packs into registers."""
    zeros = ", ".join(["np.float32(0.0)"] * PANEL)
    lines = ["", "", "@njit(cache=True, fastmath={'contract'}, boundscheck=False, error_model='numpy')",
             f"def {name}(x, m, w, p, depth, out):  # pragma: no cover - compiled"]
    lines += ["    " + ", ".join(f"s{i}_{j}" for j in range(PANEL)) + f" = {zeros}" for i in range(rows)]
    lines.append("    for k in range(depth):")
    lines += [f"        w{j} = " + load.format(j=j) for j in range(PANEL)]
    for i in range(rows):
        lines.append(f"        x{i} = x[m + {i}, k]")
        lines += [f"        s{i}_{j} += x{i} * w{j}" for j in range(PANEL)]
    for i in range(rows):
        lines += [f"    out[m + {i}, p * {PANEL} + {j}] = s{i}_{j}" for j in range(PANEL)]
    return lines


_KERNEL = '''

@njit(cache=True)
def key_product(x, rows, panels, p, depth, out):  # pragma: no cover - compiled
    """out[:rows, 16p .. 16p + 15] = x[:rows, :depth] @ key panel p (panels [P, depth, 16])."""
    held = rows // 4 * 4
    for m in range(0, held, 4):
        key_four(x, m, panels, p, depth, out)
    for m in range(held, rows):
        key_one(x, m, panels, p, depth, out)


@njit(cache=True)
def value_product(x, rows, values, p, depth, out):  # pragma: no cover - compiled
    """out[:rows, 16p .. 16p + 15] = x[:rows, :depth] @ values[:depth, p, :] (values [keys, d / 16, 16])."""
    held = rows // 4 * 4
    for m in range(0, held, 4):
        value_four(x, m, values, p, depth, out)
    for m in range(held, rows):
        value_one(x, m, values, p, depth, out)


@njit(cache=True)
def key_panels(keys, n, panels):  # pragma: no cover - compiled
    """keys [>= n, d] -> panels [>= ceil(n / 16), d, 16]: panel p, dimension c, lane l holds dimension c of key
    16p + l; the lanes past n up to a multiple of 16 are zeros."""
    dim = keys.shape[1]
    for key in range(n):
        p, lane = key // 16, key % 16
        for c in range(dim):
            panels[p, c, lane] = keys[key, c]
    for key in range(n, (n + 15) // 16 * 16):
        for c in range(dim):
            panels[key // 16, c, key % 16] = 0


@njit(parallel=True, cache=True)
def attend(q, k, v, slots, lengths, news, scale, out):  # pragma: no cover - compiled
    """q [b, T, H, d]; k, v [slots, KV, capacity, d]; slots, lengths, news int64 [b]: each row's cache row, cached
    keys and new tokens; out [b, T, H, d]. New token t < news[r] of row r sees keys 0 .. lengths[r] + t; the padding
    tokens after news[r] get zeros."""
    b, num_new, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    blocks = (num_new + QUERY_BLOCK - 1) // QUERY_BLOCK
    pairs = b * kv_heads
    most = 0
    for r in range(b):
        most = max(most, lengths[r] + news[r])
    key_pack = np.empty((b, kv_heads, (most + 15) // 16, dim, 16), dtype=np.float32)
    for pair in prange(pairs):
        r, h = pair // kv_heads, pair % kv_heads
        key_panels(k[slots[r], h], lengths[r] + news[r], key_pack[r, h])
    for task in prange(pairs * blocks):
        # blocks zigzag (first, last, second, second last, ...): later blocks see more keys, and each thread's
        # contiguous share of the tasks gets a mix
        j = task // pairs
        block = j // 2 if j % 2 == 0 else blocks - 1 - j // 2
        r, h = (task % pairs) // kv_heads, (task % pairs) % kv_heads
        first = block * QUERY_BLOCK
        end = min(num_new, first + QUERY_BLOCK)
        last = min(end, news[r])  # the block's real tokens: first .. last - 1
        for t in range(max(first, last), end):
            for g in range(group):
                out[r, t, h * group + g, :] = 0
        if last > first:
            attend_block(q[r], key_pack[r, h], v[slots[r], h], h, first, last, lengths[r], group, scale, out[r])


@njit(fastmath=True, cache=True)
def attend_block(q, panels, values, h, first, last, length, group, scale, out):  # pragma: no cover - compiled
    """One row's tokens first .. last - 1 for key/value head h's query heads (attend's task): q and out [T, H, d] of
    that row; panels its head's repacked keys; values its head's cached values [capacity, d]."""
    dim = q.shape[2]
    count = last - first
    n = length + last  # keys the block's last token sees; the others see a prefix of them
    rows = group * count  # the group's query heads stacked: row g x count + i is head g's token first + i
    queries = np.empty((rows, dim), dtype=np.float32)
    for g in range(group):
        for i in range(count):
            queries[g * count + i, :] = q[first + i, h * group + g, :]
    scores = np.empty((rows, (n + 15) // 16 * 16), dtype=np.float32)
    for p in range((n + 15) // 16):
        key_product(queries, rows, panels, p, dim, scores)
    totals = np.empty(rows, dtype=np.float32)
    for row in range(rows):
        seen = length + first + row % count + 1
        line = scores[row]
        for j in range(seen):
            line[j] = line[j] * scale
        totals[row] = exp_shifted(line, seen, peak(line, seen))
        for j in range(seen, n):
            line[j] = 0
    sums = np.empty((rows, dim), dtype=np.float32)
    by_panel = values.reshape(values.shape[0], dim // 16, 16)
    for p in range(dim // 16):
        value_product(scores, rows, by_panel, p, n, sums)
    for g in range(group):
        for i in range(count):
            inverse = np.float32(1.0) / totals[g * count + i]
            for x in range(dim):
                out[first + i, h * group + g, x] = sums[g * count + i, x] * inverse
'''


def kernel_source() -> str:
    """The generated module: the four panel products (keys or values, 4 rows or 1) and the attention over them."""
    lines = ["import numpy as np", "from numba import njit, prange", "",
             "from specdec_core.kernels.fast_exp import exp_shifted, peak", "", f"QUERY_BLOCK = {QUERY_BLOCK}"]
    for operand, load in (("key", "w[p, k, {j}]"), ("value", "w[k, p, {j}]")):
        lines += _product_lines(f"{operand}_four", 4, load) + _product_lines(f"{operand}_one", 1, load)
    return "\n".join(lines) + "\n" + _KERNEL


def _compile():
    module = load_generated(MODULE_NAME, kernel_source())
    use_torch_threads()
    with slp_vectorized():  # the products' sums into AVX registers
        module.attend.compile("(float32[:, :, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int64[::1], "
                              "int64[::1], int64[::1], float32, float32[:, :, :, ::1])")
    return module.attend


kernel = LazyKernel(_compile, "the fp32 prompt attention", "; long fp32 forwards attend through SDPA")


def usable(head_dim: int) -> bool:
    """Whether a model's heads suit the kernel (whole panels of 16 dimensions) and numba compiles it here."""
    return head_dim % PANEL == 0 and kernel() is not None


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
           news: torch.Tensor, scale: float) -> torch.Tensor:
    """query [b, H, T, d] fp32; keys/values the layer's whole fp32 buffers [slots, KV, capacity, d]; slots [b] each
    row's cache row; lengths [b] its cached keys; news [b] its new tokens (a chain) -> [b, T, H, d] fp32."""
    if keys.dtype != torch.float32 or not keys.is_contiguous() or not values.is_contiguous():
        raise TypeError(f"the fp32 prompt attention reads contiguous fp32 caches, not {keys.dtype}")
    b, heads, num_new, dim = query.shape
    q = query.detach().transpose(1, 2).contiguous()  # [b, T, H, d]: the fast forward's own layout, so no copy
    out = torch.empty(b, num_new, heads, dim)
    use_torch_threads()
    kernel()(q.numpy(), keys.detach().numpy(), values.detach().numpy(), slots.numpy().astype(np.int64),
             lengths.numpy().astype(np.int64), news.numpy().astype(np.int64), np.float32(scale), out.numpy())
    return out
