"""Draft trees: a draft may carry several branches as (token, parent) nodes; index arithmetic lives here.

Node numbering, per row and per step: node 0 is the pending token (the tree's root, already accepted), node i + 1 is
draft token i, whose parent node is `parents[i] + 1` (`parents[i] = -1`: a child of the root). Parents always come
before their children, so any prefix of the node list is itself a tree (truncation keeps a valid tree).

Worked example: branches [5, 6, 7] and [5, 8] share their first token, so the trie is
    tokens  [5, 6, 7, 8]     parents [-1, 0, 1, 0]
    nodes   0=pending  1=5  2=6  3=7  4=8        depth [0, 1, 2, 3, 2]
    node 3 attends nodes 0, 1, 2, 3; node 4 attends nodes 0, 1, 4. Positions = row length + depth.
If the target accepts 5 then 8, the accepted path is nodes [1, 4]; node 4's keys sit at offset 4 of the step and
move to offset 2 (its depth), where a chain would have put them.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from ..kernels.numba_kernels import LazyKernel


def chain_parents(length: int) -> list[int]:
    return list(range(-1, length - 1))


def build_trie(branches: list[list[int]]) -> tuple[list[int], list[int]]:
    """Merge continuations into one trie -> (tokens, parents); the first branch's nodes come first, unbroken."""
    tokens, parents, _ = build_trie_with_origins(branches)
    return tokens, parents


def build_trie_with_origins(branches: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """build_trie, plus each node's origin: the index of the first branch that holds it."""
    tokens: list[int] = []
    parents: list[int] = []
    origins: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent index, token) -> node index
    for branch_index, branch in enumerate(branches):
        parent = -1
        for token in branch:
            node = children.get((parent, token))
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                origins.append(branch_index)
                children[(parent, token)] = node
            parent = node
    return tokens, parents, origins


def depths(parents: list[int]) -> list[int]:
    """Depth of each draft token (1 = a child of the root)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def prefix_depths(parents: list[int]) -> list[int]:
    """[n - 1] -> the deepest node among the first n draft tokens (what a tree cut to n nodes can accept at most)."""
    deepest, out = 0, []
    for depth in depths(parents):
        deepest = max(deepest, depth)
        out.append(deepest)
    return out


def ancestor_mask(parents: list[int], width: int) -> torch.Tensor:
    """[width, width] bool: node t may attend node i (i is t's ancestor or t itself); nodes past the tree see
    nothing new (padding: they still see the cached prefix, which the mask builder adds)."""
    return torch.from_numpy(ancestor_array(parents, width))


def ancestor_array(parents: list[int], width: int) -> np.ndarray:
    """ancestor_mask as a numpy array (the decode loop builds a step's masks in numpy: a torch op on a row of a
    few nodes costs microseconds of dispatch, a step of 64 rows many of them)."""
    visible = np.zeros((width, width), dtype=bool)
    visible[0, 0] = True
    for index, parent in enumerate(parents):
        node = index + 1
        visible[node] = visible[parent + 1]
        visible[node, node] = True
    return visible


def trees_into(visible: np.ndarray, offsets: np.ndarray, rows: list[int], parents: list[list[int]]) -> None:
    """Write the trees of a step's tree rows into its masks: visible [B, T, T] row rows[i] = ancestor_array(parents[i]),
    offsets [B, T] row rows[i], nodes 1..n = depths(parents[i]) (the rest untouched). One compiled call for every
    tree row of the step where numba compiles; else row by row."""
    kernel = tree_kernel()
    if kernel is None:
        for row, tree in zip(rows, parents):
            offsets[row, 1:len(tree) + 1] = depths(tree)
            visible[row] = ancestor_array(tree, visible.shape[1])
        return
    ends = np.cumsum([len(tree) for tree in parents], dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(parents), np.int64, int(ends[-1]) if len(ends) else 0)
    kernel(visible, offsets, np.asarray(rows, np.int64), flat, ends)


def _compile_trees():
    from numba import njit

    @njit(cache=True)
    def fill(visible, offsets, rows, flat, ends):  # pragma: no cover - compiled
        width = visible.shape[1]
        for index in range(rows.shape[0]):
            row, start = rows[index], ends[index - 1] if index > 0 else 0
            shown = visible[row]
            shown[:, :] = False
            shown[0, 0] = True
            for at in range(ends[index] - start):
                parent, node = flat[start + at], at + 1
                for column in range(width):
                    shown[node, column] = shown[parent + 1, column]
                shown[node, node] = True
                offsets[row, node] = 1 if parent < 0 else offsets[row, parent + 1] + 1

    return fill


tree_kernel = LazyKernel(_compile_trees, "compiled draft tree masks", "; each tree row built in numpy")


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """node -> its child nodes in draft order (node numbering as above)."""
    out: dict[int, list[int]] = {}
    for index, parent in enumerate(parents):
        out.setdefault(parent + 1, []).append(index + 1)
    return out


def frequency_trie(branches: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """REST's draft tree: merge the branches into a trie counting how many pass through each node, keep the `budget`
    most frequent nodes (a child never outnumbers its parent, and ties go to the shallower, then the earlier node,
    so what is kept is a tree) -> (tokens, parents) with parents before children."""
    tokens, parents, _ = build_trie_with_origins(branches)
    counts = [0] * len(tokens)
    children: dict[tuple[int, int], int] = {(parents[i], tokens[i]): i for i in range(len(tokens))}
    for branch in branches:
        parent = -1
        for token in branch:
            parent = children[(parent, token)]
            counts[parent] += 1
    node_depths = depths(parents)
    kept = sorted(sorted(range(len(tokens)), key=lambda i: (-counts[i], node_depths[i], i))[:budget])
    new_index = {old: new for new, old in enumerate(kept)}
    return [tokens[i] for i in kept], [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
