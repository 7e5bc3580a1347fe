"""A decode or verify step's attention on a GPU, split along the keys (Triton): for graph_step.py's `split` attention.

SDPA's kernels give each (row, key head) one program that walks all of its keys: at batch 64 with two key heads
that is 128 programs for a GPU of 132 multiprocessors, each streaming its row's keys alone, far from the memory's
rate (docs/decisions.md, session 26). Here each (row, key head) is split into `splits` ranges of keys, each range a
program with its own running softmax (maximum, sum, weighted values in fp32), and a second kernel merges the
ranges, as flash-decoding does. A row's keys past its last new node are never read.

Layout (graph_step.py's folded one): query [b, KV, Q, d] (the query heads of one key head side by side along Q =
group x T), keys and values [b, KV, L, d] (views of the cache), an additive mask [b, 1, Q, L] and ends [b] (the keys
of each row worth reading: its cached length + T) -> [b, KV, Q, d]. fp32 products are IEEE (no TF32), so fp32 steps
give the tokens SDPA gives.

Triton is the GPU image's; on a CPU the tests run these kernels in Triton's interpreter (TRITON_INTERPRET=1 set
before Triton's first import, in a process of their own). `attend` returns None where it does not apply (no Triton, a
CPU outside the interpreter, a head size that is not a power of two, more than MAX_QUERIES queries a key head, or
after the kernels failed once here, with one log line): the caller runs SDPA.
"""

from __future__ import annotations

import logging
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `attend` declines
    triton = None

log = logging.getLogger(__name__)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it as it defines the kernels below
MAX_QUERIES = 64  # queries a key head (group x T) one program holds; wider steps (trees) stay on SDPA
BLOCK_N = 64  # keys a loop iteration reads


_failed = False  # set once the kernels failed here (a compile or launch error): SDPA from then on


def usable() -> bool:
    return triton is not None and not _failed


if triton is not None:
    @triton.jit
    def _ranges(q_ptr, k_ptr, v_ptr, mask_ptr, ends_ptr, part_ptr, stats_ptr,
                sq_b, sq_h, sq_q, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_q,
                kv_heads, queries, keys_per_split, scale,
                SPLITS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):
        """Program (row x key head, split): its range of keys -> unnormalised output [BLOCK_Q, d], max and sum."""
        pair = tl.program_id(0)
        split = tl.program_id(1)
        row = pair // kv_heads
        head = pair % kv_heads
        end = tl.load(ends_ptr + row)
        start = split * keys_per_split
        stop = tl.minimum(start + keys_per_split, end)
        qi = tl.arange(0, BLOCK_Q)
        di = tl.arange(0, HEAD_DIM)
        real = qi < queries
        q = tl.load(q_ptr + row * sq_b + head * sq_h + qi[:, None] * sq_q + di[None, :], mask=real[:, None], other=0.0)
        most = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
        # A constant trip count with the dead blocks skipped (the interpreter takes no loop bound read from memory)
        for block in range(0, BLOCKS):
            first = start + block * BLOCK_N
            if first < stop:
                ki = first + tl.arange(0, BLOCK_N)
                live = ki < stop
                k = tl.load(k_ptr + row * sk_b + head * sk_h + ki[:, None] * sk_l + di[None, :],
                            mask=live[:, None], other=0.0)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_Q, BLOCK_N] fp32
                bias = tl.load(mask_ptr + row * sm_b + qi[:, None] * sm_q + ki[None, :],
                               mask=real[:, None] & live[None, :], other=float("-inf"))
                scores = scores + bias.to(tl.float32)
                new_most = tl.maximum(most, tl.max(scores, 1))
                safe = tl.where(new_most == float("-inf"), 0.0, new_most)  # a query that has seen no key yet
                weights = tl.exp(scores - safe[:, None])
                rescale = tl.exp(most - safe)
                total = total * rescale + tl.sum(weights, 1)
                v = tl.load(v_ptr + row * sv_b + head * sv_h + ki[:, None] * sv_l + di[None, :],
                            mask=live[:, None], other=0.0)
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
                most = new_most
        base = pair * SPLITS + split
        tl.store(part_ptr + base * BLOCK_Q * HEAD_DIM + qi[:, None] * HEAD_DIM + di[None, :], acc)
        tl.store(stats_ptr + (base * 2) * BLOCK_Q + qi, most)
        tl.store(stats_ptr + (base * 2 + 1) * BLOCK_Q + qi, total)

    @triton.jit
    def _merge(part_ptr, stats_ptr, out_ptr, so_b, so_h, so_q, kv_heads, queries,
               SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Program (row x key head): its ranges merged by their maxima -> the attention's output rows."""
        pair = tl.program_id(0)
        row = pair // kv_heads
        head = pair % kv_heads
        qi = tl.arange(0, BLOCK_Q)
        di = tl.arange(0, HEAD_DIM)
        most = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        for split in tl.static_range(SPLITS):
            most = tl.maximum(most, tl.load(stats_ptr + ((pair * SPLITS + split) * 2) * BLOCK_Q + qi))
        safe = tl.where(most == float("-inf"), 0.0, most)
        total = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
        for split in tl.static_range(SPLITS):
            base = pair * SPLITS + split
            weight = tl.exp(tl.load(stats_ptr + (base * 2) * BLOCK_Q + qi) - safe)  # 0 for a range with no key
            total += weight * tl.load(stats_ptr + (base * 2 + 1) * BLOCK_Q + qi)
            acc += weight[:, None] * tl.load(part_ptr + base * BLOCK_Q * HEAD_DIM + qi[:, None] * HEAD_DIM
                                             + di[None, :])
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # (padding queries: no key, no division by zero)
        tl.store(out_ptr + row * so_b + head * so_h + qi[:, None] * so_q + di[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(qi < queries)[:, None])


def default_splits(pairs: int, keys: int, device: torch.device) -> int:
    """Ranges a (row, key head) is split into: enough programs for about four per multiprocessor, a power of two
    from 1 to 16, and no range shorter than one block of keys."""
    processors = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8)
    splits = 1
    while splits < 16 and pairs * splits < 4 * processors and keys > splits * 2 * BLOCK_N:
        splits *= 2
    return splits


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, ends: torch.Tensor,
           scale: float, splits: int | None = None) -> torch.Tensor | None:
    """query [b, KV, Q, d], keys / values [b, KV, L, d] (any strides with a unit last one), mask [b, 1, Q, L]
    additive, ends [b] (int32 spares a conversion) -> [b, KV, Q, d] in the query's dtype, or None where these kernels do not apply."""
    global _failed
    rows, kv_heads, queries, head_dim = query.shape
    if (not usable() or (query.device.type != "cuda" and not INTERPRETED) or queries > MAX_QUERIES
            or head_dim & (head_dim - 1) or head_dim < 16
            or keys.stride(-1) != 1 or values.stride(-1) != 1 or query.stride(-1) != 1):
        return None
    mask = mask.contiguous()
    length = keys.shape[2]
    splits = splits or default_splits(rows * kv_heads, length, query.device)
    per_split = -(-length // splits)
    per_split = -(-per_split // BLOCK_N) * BLOCK_N  # whole blocks a range
    splits = -(-length // per_split)  # (rounding up may leave the last ranges nothing to read)
    block_q = max(16, triton.next_power_of_2(queries))
    part = torch.empty(rows * kv_heads * splits * block_q * head_dim, dtype=torch.float32, device=query.device)
    stats = torch.empty(rows * kv_heads * splits * 2 * block_q, dtype=torch.float32, device=query.device)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # (the mode of fp32 operands only)
    try:
        _ranges[(rows * kv_heads, splits)](
            query, keys, values, mask, ends.to(torch.int32), part, stats,
            query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), mask.stride(0), mask.stride(2),
            kv_heads, queries, per_split, scale,
            SPLITS=splits, BLOCKS=per_split // BLOCK_N, BLOCK_Q=block_q, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim,
            PRECISION=precision)
        _merge[(rows * kv_heads,)](part, stats, out, out.stride(0), out.stride(1), out.stride(2), kv_heads, queries,
                                   SPLITS=splits, BLOCK_Q=block_q, HEAD_DIM=head_dim)
    except Exception as exc:  # what failed once would fail again: SDPA serves the process from now on
        log.warning("split attention failed at queries %s, keys %s (%s: %s); SDPA from now on", tuple(query.shape),
                    tuple(keys.shape), type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        _failed = True
        return None
    return out
