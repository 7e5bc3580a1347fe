"""Attention over the slot cache through torch's `flex_attention`, with no `[b, T, L]` mask: each row attends its own
cached keys and the step's new nodes it is shown, and the blocks of keys it never sees are skipped.

For GPUs (issue 50). SDPA with a mask runs its memory-efficient kernel over every padded key of every row and reads
the mask for each score; the flash kernels take no mask at all. Here the mask is a rule, not a tensor:
    key j of row r is a cached token when j < lengths[r]; new node i = j - lengths[r] when 0 <= i < T,
    seen by node t when visible[r, t, i] or i == t (a padding node sees itself); else dead
(attention_masks.visible_keys's rule). The block mask tells the kernel, per block of 128 queries and 128 keys, which
blocks are wholly seen (no rule evaluated), which partly (the rule evaluated: the one or two blocks that hold a row's
new nodes) and which are skipped: every key past a row's last new node, and every query block of padding. So a
row costs its own keys, as in a ragged layout, while the cache keeps its padded `[slots, KV, capacity, d]` form.

Nodes only see nodes before them (a tree's parents come before their children, draft_tree.py): the block mask
prunes on that, the rule does not rely on it.

The mode (`SPECBATCH_GPU_ATTENTION`): `auto` (the default: a step whose graphs are captured times its first bucket
with each and keeps the faster, graph_step.py; everything else attends through `sdpa`), `sdpa` (the masked SDPA),
`flex`, or `split` (graph-ready steps through kernels/split_kv_attention.py, the rest through `sdpa`). On a CUDA device `flex_attention` runs compiled (its eager form builds the whole score matrix); elsewhere
eagerly, which is how the CPU suite checks it. Where the compiled kernel fails, masked SDPA takes over (`attend`).
benchmarks/gpu_step_roofline.py times both.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

log = logging.getLogger(__name__)

MODE_ENV = "SPECBATCH_GPU_ATTENTION"
CANDIDATES = ("sdpa", "flex")  # what `auto` times
OPT_IN = ("split",)  # graph-ready steps only, until a GPU has timed it (graph_step.py)
MODES = ("auto", *CANDIDATES, *OPT_IN)
BLOCK = 128  # queries and keys per block: flex_attention's own default block size


def attention_mode() -> str:
    """`auto`, `sdpa` or `flex` (see the module's docstring); a bad value gives one clear error."""
    mode = os.environ.get(MODE_ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: choose one of {', '.join(MODES)}")
    return mode


def block_mask(lengths: torch.Tensor, visible: torch.Tensor, keys: int, news: torch.Tensor | None = None) -> BlockMask:
    """lengths [b] cached positions of each row, visible [b, T, T] bool, keys = L the key positions attended
    (the step's new nodes at lengths[r] + i must lie within them), news [b] real nodes of each row (the first
    news[r] of T; None: all T, padding nodes seeing themselves) -> the BlockMask of the rule above.
    Tensor operations only, no host read: a captured graph holds it."""
    rows, width = visible.shape[:2]
    device = lengths.device
    lengths = lengths.long()
    news = torch.full_like(lengths, width) if news is None else news.to(device).long()
    query_blocks, key_blocks = -(-width // BLOCK), -(-keys // BLOCK)
    starts = torch.arange(query_blocks, device=device) * BLOCK  # [Qb]: each query block's first node
    active = starts[None, :] < news[:, None]  # [b, Qb]: a block of padding nodes attends nothing
    last_seen = lengths[:, None] + torch.minimum(news[:, None], starts[None, :] + BLOCK) - 1  # [b, Qb]: last key
    whole = (lengths // BLOCK)[:, None].expand(rows, query_blocks)  # blocks of cached keys only
    first_partial = lengths // BLOCK  # [b]: the block that holds the row's first new node
    partial = (last_seen // BLOCK - first_partial[:, None] + 1).clamp(min=0)  # [b, Qb]
    every = torch.arange(key_blocks, device=device, dtype=torch.int32)  # [Kb]
    partial_indices = (first_partial[:, None, None] + every.long()).clamp(max=key_blocks - 1)  # [b, 1, Kb]
    zero = torch.zeros((), dtype=torch.int32, device=device)
    # int32 and contiguous, as create_block_mask gives them (a kernel may index them by their sizes, not strides)
    kv_num = torch.where(active, partial.int(), zero)[:, None].contiguous()  # [b, 1, Qb]
    full_num = torch.where(active, whole.int(), zero)[:, None].contiguous()
    kv_indices = partial_indices[:, :, None, :].expand(rows, 1, query_blocks, key_blocks).int().contiguous()
    full_indices = every.expand(rows, 1, query_blocks, key_blocks).contiguous()  # [b, 1, Qb, Kb]
    last_node = width - 1

    def seen(row, head, node, key):
        offset = key - lengths[row]
        shown = visible[row, node.clamp(max=last_node), offset.clamp(0, last_node)]
        return (offset < 0) | ((offset < width) & (shown | (offset == node)))

    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=BLOCK, mask_mod=seen,
                                    seq_lengths=(width, keys), compute_q_blocks=False)


COMPILED_ON = ("cuda",)  # device types where flex_attention runs compiled (elsewhere eagerly: the CPU suite's checks)
_kernels: dict[str, object] = {}  # device type -> compiled flex_attention, or None once it failed there


def _kernel(device: torch.device):
    """flex_attention as it runs on `device`: compiled where COMPILED_ON says (once per process; shapes turn
    dynamic at the first recompile), else eager; None where it failed once (attend then masks SDPA)."""
    if device.type in _kernels:
        return _kernels[device.type]
    if device.type not in COMPILED_ON:
        return flex_attention
    # Past Dynamo's recompile limit a compiled function runs its eager form without a word; flex_attention's builds
    # the whole score matrix. Raising instead lets attend fall back to masked SDPA with a log line.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    _kernels[device.type] = torch.compile(flex_attention)
    return _kernels[device.type]


def kernel_state(device: torch.device | str) -> str:
    """How flex_attention runs on `device`: `eager` (not compiled there), `compiled`, `not compiled yet`, or
    `failed` (it failed there once: attend runs masked SDPA), for logs and the GPU scripts' records."""
    device = torch.device(device)
    if _kernels.get(device.type, flex_attention) is None:
        return "failed"
    if device.type not in COMPILED_ON:
        return "eager"
    return "compiled" if device.type in _kernels else "not compiled yet"


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask,
           scale: float) -> torch.Tensor:
    """query [b, H, T, d], keys and values [b, KV, L, d] (H a multiple of KV) -> [b, T, H, d].
    Where flex_attention fails (a shape its compiled kernels do not take, Dynamo's recompile limit, a device it
    does not run on), it is dropped for the process and device with one log line, and SDPA runs with the rule as a
    boolean mask: the same attention, at the masked kernel's speed."""
    kernel = _kernel(query.device)
    if kernel is not None:
        try:
            return kernel(query, keys, values, block_mask=mask, scale=scale,
                          enable_gqa=query.shape[1] != keys.shape[1]).transpose(1, 2)
        except Exception as exc:
            log.warning("flex_attention failed at queries %s, keys %s (%s: %s); masked SDPA from now on",
                        tuple(query.shape), tuple(keys.shape), type(exc).__name__, str(exc).splitlines()[0][:200])
            _kernels[query.device.type] = None
    return _masked_sdpa(query, keys, values, mask, scale)


def _masked_sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask,
                 scale: float) -> torch.Tensor:
    """attend through SDPA with the block mask's rule as a boolean mask -> [b, T, H, d]. The query heads of one key
    head lie side by side along the query axis (SDPA's enable_gqa with a mask takes its slowest kernel on CUDA)."""
    rows, heads, width, head_dim = query.shape
    kv_heads, keys_count = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    dense = getattr(mask, "dense", None)  # [b, 1, T, L] bool: built once, for every layer of the forward
    if dense is None:
        dense = mask.dense = create_mask(mask.mask_mod, rows, None, width, keys_count, device=query.device)
    allowed = dense[:, :, None].expand(rows, 1, group, width, keys_count).reshape(rows, 1, group * width, keys_count)
    folded = query.reshape(rows, kv_heads, group * width, head_dim)  # [b, KV, group T, d]
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=allowed, scale=scale)
    return out.view(rows, kv_heads, group, width, head_dim).reshape(rows, heads, width, head_dim).transpose(1, 2)
