"""A decode step's input tensors from its rows' pending tokens and drafts: token ids, positions, which nodes each node
sees, and where the verifier reads logits. Built in one compiled pass where numba compiles: on a GPU the device waits
for the host to build them every step, and numpy and torch calls per row or per array cost microseconds each.

A chain's node t sits at position length + t and sees nodes 0..t; a tree's node at length + its depth and sees its
ancestors (draft_tree.py). Padding nodes see nothing and are never read; they sit at length + t, padded id 0.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from ..drafters.base import Draft
from ..kernels.numba_kernels import LazyKernel
from .draft_tree import trees_into


def step_inputs(lengths: list[int], pending: list[int], drafts: list[Draft], width: int):
    """lengths [B]: each row's cached positions; pending [B]: its token not yet cached; drafts [B]: what it verifies
    (at most width - 1 tokens) -> ids [B, T], positions [B, T], visible [B, T, T] (bool) and logit_index [N, 2]
    (row, node) of every real node, row-major as the verifier reads them (N = sum of 1 + len(draft))."""
    kernel = inputs_kernel()
    if kernel is None:
        return python_step_inputs(lengths, pending, drafts, width)
    counts = np.fromiter((1 + len(d.tokens) for d in drafts), np.int64, len(drafts))
    tokens = np.fromiter(chain.from_iterable((p, *d.tokens) for p, d in zip(pending, drafts)), np.int64,
                         int(counts.sum()))
    trees = [d.parents for d in drafts if d.parents is not None]
    is_tree = np.fromiter((d.parents is not None for d in drafts), np.bool_, len(drafts))
    parents = np.fromiter(chain.from_iterable(trees), np.int64, sum(len(t) for t in trees))
    ids, positions, visible, logit_index = kernel(np.asarray(lengths, np.int64), counts, tokens, is_tree, parents,
                                                  width)
    return (torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(visible),
            torch.from_numpy(logit_index))


def python_step_inputs(lengths: list[int], pending: list[int], drafts: list[Draft], width: int):
    """`step_inputs` in numpy arrays and the tree rows' compiled masks (draft_tree.trees_into), where the one
    compiled pass does not compile; what that pass must equal."""
    counts = [1 + len(d.tokens) for d in drafts]
    ids = torch.tensor([[p, *d.tokens] + [0] * (width - count) for p, d, count in zip(pending, drafts, counts)],
                       dtype=torch.long).view(len(drafts), width)  # [B, T], padding id 0
    inside, visible = chain_visibility(np.array(counts, dtype=np.int64), width)  # [B, T], [B, T, T]
    offsets = np.tile(np.arange(width), (len(drafts), 1))  # [B, T]: position - length of each node
    trees = [b for b, d in enumerate(drafts) if d.parents is not None]
    if trees:
        trees_into(visible, offsets, trees, [drafts[b].parents for b in trees])
    logit_index = torch.from_numpy(np.argwhere(inside))  # [N, 2]
    positions = torch.tensor(lengths, dtype=torch.long)[:, None] + torch.from_numpy(offsets)
    return ids, positions, torch.from_numpy(visible), logit_index


_LOWER = np.ones((0, 0), dtype=bool)  # a lower triangle, grown to the widest chunk so far up to CACHED_WIDTH
CACHED_WIDTH = 4096  # (a wider one, a GPU's long prompt, is built for its call: kept, it would hold T x T bytes)


def chain_visibility(counts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """counts [B]: real nodes per row -> inside [B, T] (node t is real) and visible [B, T, T] (real node t sees real
    nodes 0..t: a chain; padding sees nothing), in numpy (see draft_tree.ancestor_array). The rows copy one cached
    triangle and clear their padding's rows: a prefill chunk's is T x T, and building it anew took longer than
    copying."""
    global _LOWER
    lower = _LOWER
    if len(lower) < width:
        lower = np.tri(width, dtype=bool)
        if width <= CACHED_WIDTH:
            _LOWER = lower
    inside = np.arange(width)[None, :] < counts[:, None]
    visible = np.repeat(lower[None, :width, :width], len(counts), axis=0)
    for row, count in enumerate(counts.tolist()):
        visible[row, count:] = False  # (a padding column is seen only from the rows below it: padding too)
    return inside, visible


def _compile():
    from numba import njit

    @njit(cache=True)
    def build(lengths, counts, tokens, is_tree, parents, width):  # pragma: no cover - compiled
        """python_step_inputs in one pass: row b's nodes are tokens[sum(counts[:b]):][:counts[b]] (its pending
        token, then its draft), a tree row's parents the next len(draft) of `parents`."""
        rows = counts.shape[0]
        ids = np.zeros((rows, width), np.int64)
        positions = np.empty((rows, width), np.int64)
        visible = np.zeros((rows, width, width), np.bool_)
        logit_index = np.empty((tokens.shape[0], 2), np.int64)
        at, tree_at = 0, 0
        for b in range(rows):
            count = counts[b]
            for t in range(width):
                positions[b, t] = lengths[b] + t
            for t in range(count):
                ids[b, t] = tokens[at + t]
                logit_index[at + t, 0] = b
                logit_index[at + t, 1] = t
            shown = visible[b]
            if is_tree[b]:
                shown[0, 0] = True
                for node in range(1, count):
                    parent = parents[tree_at + node - 1] + 1
                    for column in range(node):
                        shown[node, column] = shown[parent, column]
                    shown[node, node] = True
                    positions[b, node] = positions[b, parent] + 1  # length + its depth
                tree_at += count - 1
            else:
                for node in range(count):
                    for column in range(node + 1):
                        shown[node, column] = True
            at += count
        return ids, positions, visible, logit_index

    return build


inputs_kernel = LazyKernel(_compile, "the compiled step inputs", "; a step's inputs built in numpy")
