"""Token suffix trees with counts, and the frequency-ranked draft tree SuffixDecoding builds from their longest match
(Oliaro et al., 2024; vLLM's `method: "suffix"` runs it through Arctic Inference). Issue 30's core, not wired yet.

Where it follows the paper:
- every suffix of the indexed sequences is a path from the root, each node counting how often its path occurred;
- a draft starts at the node of the longest suffix of the row's tokens that the tree holds (up to `depth` tokens);
- the draft is a tree grown best first by the probability of its path, each step of the path weighed by
  count(child) / sum of its siblings' counts; nodes below `min_prob` are cut and the tree holds at most
  `factor` x the match length nodes (the paper's and vLLM's defaults: min_prob 0.1, factor 1.0).
Where it differs:
- a suffix trie of bounded depth (each suffix's first `depth` tokens), not a compressed suffix tree: plain dicts
  in Python, O(depth) work per appended token, no edge labels to split;
- the match is kept incrementally per sequence (`Cursor`): the nodes of its suffixes of length 1..depth, advanced by
  each new token. A path another sequence adds later is found once the cursor's suffixes reach it anew.
Cost in Python (AVX2 EPYC, random ids over 500 tokens): an append 29 us at depth 16, 181 us at depth 64; a draft
6-12 us. At depth 64 and batch 64 that is ~12 ms a step: the decode loop needs a compiled form (numba) or a
smaller depth before this goes in.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of this node's path in the indexed sequences


class Cursor:
    """A sequence being matched against (and, for `SuffixTree.append`, added to) a tree: the nodes of its
    suffixes that the tree holds, longest first, with their lengths."""

    __slots__ = ("nodes", "lengths")

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.lengths: list[int] = []


class SuffixTree:
    def __init__(self, depth: int = 64):
        if depth < 1:
            raise ValueError(f"a suffix tree needs depth >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.tokens = 0  # tokens indexed

    def cursor(self, tokens: Iterable[int] = ()) -> Cursor:
        """A cursor that has matched `tokens` (without adding them)."""
        cursor = Cursor()
        for token in tokens:
            self.advance(cursor, token)
        return cursor

    def advance(self, cursor: Cursor, token: int) -> None:
        """Match one more token: each held suffix that the tree continues with `token` grows by one, and the suffix
        of `token` alone starts where the root has it."""
        nodes, lengths = [], []
        for node, length in zip(cursor.nodes, cursor.lengths):
            child = node.children.get(token)
            if child is not None and length < self.depth:
                nodes.append(child)
                lengths.append(length + 1)
        child = self.root.children.get(token)
        if child is not None:
            nodes.append(child)
            lengths.append(1)
        cursor.nodes, cursor.lengths = nodes, lengths

    def append(self, cursor: Cursor, token: int) -> None:
        """Add one token to the sequence `cursor` indexes: every suffix of it (up to `depth` tokens) now ends with
        `token`, and counts once more. The cursor then holds all of them."""
        nodes, lengths = [], []
        for node, length in zip(cursor.nodes, cursor.lengths):
            if length < self.depth:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                nodes.append(child)
                lengths.append(length + 1)
        child = self.root.children.get(token)
        if child is None:
            child = self.root.children[token] = _Node()
        child.count += 1
        nodes.append(child)
        lengths.append(1)
        cursor.nodes, cursor.lengths = nodes, lengths
        self.tokens += 1

    def extend(self, cursor: Cursor, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(cursor, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back one sequence that `extend` added from a fresh cursor (eviction): every path of its suffixes
        counts once less, and a node left at 0 goes with its subtree (a child never counts more than its parent)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start: start + self.depth]:
                child = node.children.get(token)
                if child is None:  # (removed already, with a parent that reached 0)
                    break
                child.count -= 1
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child
        self.tokens -= len(tokens)

    def draft(self, cursor: Cursor, max_tokens: int, factor: float = 1.0, min_prob: float = 0.1) -> "TreeDraft":
        """The best draft tree over the held suffixes: each match length L may grow min(max_tokens, factor x L)
        nodes, and the tree whose nodes' probabilities sum highest (its expected accepted tokens) wins, as Arctic
        Inference scores them. A shorter match has fewer nodes but more room below it in a depth-bounded trie."""
        best = TreeDraft([], [], 0, 0.0)
        for node, length in zip(cursor.nodes, cursor.lengths):
            budget = min(max_tokens, math.floor(factor * length))
            if budget <= best.score:  # longest first, so no later budget (a score is at most its node count) wins
                break
            if node.children:
                tokens, parents, score = best_first_tree(node, budget, min_prob)
                if score > best.score:
                    best = TreeDraft(tokens, parents, length, score)
        return best


@dataclass(frozen=True, eq=False)
class TreeDraft:
    tokens: list[int]
    parents: list[int]  # parents[i]: index of token i's parent (-1 = the row's last token); parents first
    match_length: int  # of the suffix the tree continues (0: nothing matched)
    score: float  # sum of the nodes' path probabilities: the tokens a greedy verifier is expected to accept


def best_first_tree(start: _Node, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """Grow a tree below `start` by the probability of each path (the product of count(child) / sum of the counts of
    its siblings along it), most probable first, until `max_nodes` nodes or every candidate is below `min_prob`.
    -> (tokens, parents, the sum of the taken nodes' probabilities), nodes in the order taken (parents first)."""
    tokens: list[int] = []
    parents: list[int] = []
    order = 0  # ties go to the earlier-pushed candidate, so the tree is deterministic
    frontier: list[tuple[float, int, int, int, _Node]] = []

    def push(node: _Node, prob: float, parent: int) -> None:
        nonlocal order
        total = sum(child.count for child in node.children.values())
        for token, child in node.children.items():
            p = prob * child.count / total
            if p >= min_prob:
                heapq.heappush(frontier, (-p, order, parent, token, child))
                order += 1

    push(start, 1.0, -1)
    score = 0.0
    while frontier and len(tokens) < max_nodes:
        negative, _, parent, token, node = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        score -= negative
        push(node, -negative, len(tokens) - 1)
    return tokens, parents, score


def index_sequences(sequences: Iterable[Sequence[int]], depth: int = 64) -> SuffixTree:
    """A tree over whole sequences (each indexed from its own start: no suffix crosses two of them)."""
    tree = SuffixTree(depth)
    for sequence in sequences:
        tree.extend(Cursor(), sequence)
    return tree
