"""The compiled pass of suffix_batch.py: every pending `suffix` row's `_extend_and_draft` in one call, the rows
spread over threads in the parallel variant. Each row touches its own tree and cursors; the job memory's tree is
only read (its cursors are the rows' own), so the rows are independent."""

from __future__ import annotations

from ..kernels.numba_kernels import use_numba_cache

use_numba_cache()
from numba import njit, prange  # noqa: E402  (after the cache directory is set)

from .suffix_tree import _extend_and_draft  # noqa: E402


@njit(cache=True)
def _row(trees, cursors, memory, asked, k, out, found):  # pragma: no cover - compiled
    """Row k of `asked`: its new tokens into its tree and its memory cursor, its draft into out[.][k], and (nodes,
    1 where the memory's tree won, 1 where the draft is a chain) into found[k]."""
    nodes, keys, values, metas, frees = trees
    cursor_nodes, cursor_lengths, cursor_sizes = cursors
    memory_tree, memory_nodes, memory_lengths, memory_sizes, has_memory, depths = memory
    slots, tokens, offsets, max_tokens, factor, min_prob = asked
    slot = slots[k]
    tree = (nodes[slot], keys[slot], values[slot], metas[slot], frees[slot])
    cursor = (cursor_nodes[slot], cursor_lengths[slot], cursor_sizes[slot])
    if has_memory:
        other, other_cursor = memory_tree, (memory_nodes[slot], memory_lengths[slot], memory_sizes[slot])
    else:
        other, other_cursor = tree, cursor
    out_tokens, out_parents, out_probs = out
    taken, _, _, swapped = _extend_and_draft(tree, cursor, tokens[offsets[k]:offsets[k + 1]], other, other_cursor,
                                             has_memory, depths, (max_tokens[k], factor, min_prob),
                                             (out_tokens[k], out_parents[k], out_probs[k]))
    chain = 1
    for node in range(taken):
        if out_parents[k, 0, node] != node - 1:
            chain = 0
    found[k, 0] = taken
    found[k, 1] = swapped
    found[k, 2] = chain


@njit(cache=True)
def extend_and_draft_rows(trees, cursors, memory, asked, out, found):  # pragma: no cover - compiled
    """trees: the slots' (nodes, keys, values, meta, free) as typed lists; cursors: their own trees' cursors
    (nodes, lengths, size); memory: (the memory tree's arrays, the slots' memory cursors' three lists, whether
    there is a memory, (depth, memory depth)); asked: (slots [K], new tokens of all rows [M], offsets [K + 1],
    max_tokens [K], factor, min_prob); out: (tokens, parents, probs) [K, 2, width]; found [K, 3]."""
    for k in range(asked[0].shape[0]):
        _row(trees, cursors, memory, asked, k, out, found)


@njit(cache=True, parallel=True)
def extend_and_draft_rows_parallel(trees, cursors, memory, asked, out, found):  # pragma: no cover - compiled
    """`extend_and_draft_rows`, the rows spread over numba's threads. (A parallel loop takes no tuple of arrays
    from outside it: each is unpacked before the loop and packed again inside.)"""
    nodes, keys, values, metas, frees = trees
    cursor_nodes, cursor_lengths, cursor_sizes = cursors
    memory_tree, memory_nodes, memory_lengths, memory_sizes, has_memory, depths = memory
    tree_nodes, tree_keys, tree_values, tree_meta, tree_free = memory_tree
    depth, memory_depth = depths
    slots, tokens, offsets, max_tokens, factor, min_prob = asked
    out_tokens, out_parents, out_probs = out
    for k in prange(slots.shape[0]):
        _row((nodes, keys, values, metas, frees), (cursor_nodes, cursor_lengths, cursor_sizes),
             ((tree_nodes, tree_keys, tree_values, tree_meta, tree_free), memory_nodes, memory_lengths, memory_sizes,
              has_memory, (depth, memory_depth)), (slots, tokens, offsets, max_tokens, factor, min_prob), k,
             (out_tokens, out_parents, out_probs), found)


def empty_lists():
    """The typed lists a SuffixBatch keeps its slots' arrays in: (trees, cursors, memory cursors)."""
    from numba import typed, types

    nodes, table = types.Array(types.int32, 2, "C"), types.Array(types.int64, 1, "A")
    meta, free, cursor = types.Array(types.int64, 1, "C"), types.Array(types.int32, 1, "C"), types.int64[::1]
    trees = tuple(typed.List.empty_list(kind) for kind in (nodes, table, table, meta, free))
    cursors = tuple(typed.List.empty_list(cursor) for _ in range(3))
    memory_cursors = tuple(typed.List.empty_list(cursor) for _ in range(3))
    return trees, cursors, memory_cursors
