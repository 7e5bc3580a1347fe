"""Token suffix trees with counts, and the frequency-ranked draft tree SuffixDecoding builds from their longest match
(Oliaro et al., 2024; vLLM's `method: "suffix"` runs it through Arctic Inference).

Where it follows the paper:
- every suffix of the indexed sequences is a path from the root, each node counting how often its path occurred;
- a draft starts at the node of a suffix of the row's tokens that the tree holds (up to `depth` tokens);
- the draft is a tree grown best first by the probability of its path, each step of the path weighed by
  count(child) / sum of its siblings' counts; nodes below `min_prob` are cut and the tree holds at most
  `factor` x the match length nodes (the paper's and vLLM's defaults: min_prob 0.1, factor 1.0); of the held
  suffixes, the one whose tree has the highest expected accepted length (the sum of its nodes' probabilities) wins,
  as Arctic Inference scores them.
Where it differs:
- a suffix trie of bounded depth (each suffix's first `depth` tokens), not a compressed suffix tree: O(depth) work
  per appended token, no edge labels to split; a match and its draft both fit in `depth` tokens;
- the match is kept incrementally per sequence (`Cursor`): the nodes of its held suffixes, advanced by each new
  token. A path another sequence adds later is found once the cursor's suffixes reach it anew. A draft may start
  from a cursor a few tokens behind: it looks those tokens up only from the suffixes its search reaches;
- the trie lives in arrays (a node table, a hash table from (parent, token) to child) that numba-compiled loops
  walk, because every row indexes its whole prompt at admission (costs in docs/decisions.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..kernels.numba_kernels import use_numba_cache

use_numba_cache()
from numba import njit  # noqa: E402  (after the cache directory is set)

# Node table columns: the node's token, its count, its first and last child, its next sibling, its parent.
TOKEN, COUNT, FIRST, LAST, NEXT, PARENT = range(6)
ROOT = 0
EMPTY, TOMBSTONE = -1, -2  # hash-table keys that hold no entry
# meta: rows of the node table in use, free rows on the free list, hash slots filled (tombstones included), and
# the sum of `_touch`'s last loads (stored so that the loads are kept)
USED, FREE, FILLED, TOUCHED = range(4)
MAX_TOKEN = 1 << 24  # a key is parent << 24 | token
APPEND_CHUNK = 256  # tokens appended per compiled call


@njit(cache=True)
def _key(parent, token):  # pragma: no cover - compiled
    """The hash table's key of `parent`'s child for `token`."""
    return (np.int64(parent) << 24) | np.int64(token)


@njit(cache=True)
def _home(keys, key):  # pragma: no cover - compiled
    """The first slot of `key`'s probe path."""
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)) & (keys.shape[0] - 1)


@njit(cache=True)
def _touch(keys, meta, cursor_nodes, cursor_lengths, size, token, depth):  # pragma: no cover - compiled
    """Load the home slot of each held suffix's child for `token` before any is used: the loads are independent, so
    the core overlaps their cache misses, which the lookups one after another would pay in turn."""
    loaded = 0
    for held in range(size):
        if cursor_lengths[held] < depth:
            loaded += keys[_home(keys, _key(cursor_nodes[held], token))]
    meta[TOUCHED] = loaded


@njit(cache=True)
def _slot(keys, key):  # pragma: no cover - compiled
    """The slot holding `key`, else the slot it would go to (the first tombstone or empty one on its probe path)."""
    mask = keys.shape[0] - 1
    index = _home(keys, key)
    free = -1
    while True:
        held = keys[index]
        if held == key:
            return index
        if held == EMPTY:
            return free if free >= 0 else index
        if held == TOMBSTONE and free < 0:
            free = index
        index = (index + 1) & mask


@njit(cache=True)
def _child(nodes, keys, values, meta, free, parent, token, create):  # pragma: no cover - compiled
    """The child of `parent` for `token`; a new one (count 0) when `create`, else -1 when there is none."""
    key = _key(parent, token)
    slot = _slot(keys, key)
    if keys[slot] == key:
        return values[slot]
    if not create:
        return -1
    if meta[FREE] > 0:
        meta[FREE] -= 1
        node = free[meta[FREE]]
    else:
        node = meta[USED]
        meta[USED] += 1
    nodes[node, TOKEN] = token
    nodes[node, COUNT] = 0
    nodes[node, FIRST] = -1
    nodes[node, LAST] = -1
    nodes[node, NEXT] = -1
    nodes[node, PARENT] = parent
    if nodes[parent, LAST] < 0:  # children in the order they first occurred
        nodes[parent, FIRST] = node
    else:
        nodes[nodes[parent, LAST], NEXT] = node
    nodes[parent, LAST] = node
    if keys[slot] == EMPTY:
        meta[FILLED] += 1
    keys[slot] = key
    values[slot] = node
    return node


@njit(cache=True)
def _append(nodes, keys, values, meta, free, cursor_nodes, cursor_lengths, cursor_size, tokens,
            depth):  # pragma: no cover - compiled
    """Add tokens to the sequence the cursor holds: each held suffix shorter than `depth` grows by the token, the
    token alone starts a new one, and every one of them counts once more."""
    size = cursor_size[0]
    for token in tokens:
        _touch(keys, meta, cursor_nodes, cursor_lengths, size, token, depth)
        kept = 0
        for held in range(size):  # longest first; kept <= held, so the arrays are rewritten in place
            if cursor_lengths[held] < depth:
                node = _child(nodes, keys, values, meta, free, cursor_nodes[held], token, True)
                nodes[node, COUNT] += 1
                cursor_nodes[kept] = node
                cursor_lengths[kept] = cursor_lengths[held] + 1
                kept += 1
        node = _child(nodes, keys, values, meta, free, ROOT, token, True)
        nodes[node, COUNT] += 1
        cursor_nodes[kept] = node
        cursor_lengths[kept] = 1
        size = kept + 1
    cursor_size[0] = size


@njit(cache=True)
def _advance(nodes, keys, values, meta, free, cursor_nodes, cursor_lengths, cursor_size, tokens,
             depth):  # pragma: no cover - compiled
    """Match tokens without adding them: the held suffixes the tree continues grow, the others are dropped."""
    size = cursor_size[0]
    for token in tokens:
        _touch(keys, meta, cursor_nodes, cursor_lengths, size, token, depth)
        kept = 0
        for held in range(size):
            if cursor_lengths[held] < depth:
                node = _child(nodes, keys, values, meta, free, cursor_nodes[held], token, False)
                if node >= 0:
                    cursor_nodes[kept] = node
                    cursor_lengths[kept] = cursor_lengths[held] + 1
                    kept += 1
        node = _child(nodes, keys, values, meta, free, ROOT, token, False)
        if node >= 0:
            cursor_nodes[kept] = node
            cursor_lengths[kept] = 1
            kept += 1
        size = kept
    cursor_size[0] = size


@njit(cache=True)
def _remove(nodes, keys, values, meta, free, tokens, depth):  # pragma: no cover - compiled
    """Take back a sequence `_append` added from an empty cursor: every path of its suffixes counts once less, and a
    node left at 0 goes with its subtree (a child never counts more than its parent, so all of it is at 0 too)."""
    stack = np.empty(64, np.int64)
    for start in range(tokens.shape[0]):
        node = ROOT
        for position in range(start, min(start + depth, tokens.shape[0])):
            child = _child(nodes, keys, values, meta, free, node, tokens[position], False)
            if child < 0:
                break
            nodes[child, COUNT] -= 1
            if nodes[child, COUNT] > 0:
                node = child
                continue
            # Unlink it from its parent's children, then free it and everything below it.
            previous, sibling = -1, nodes[node, FIRST]
            while sibling != child:
                previous, sibling = sibling, nodes[sibling, NEXT]
            if previous < 0:
                nodes[node, FIRST] = nodes[child, NEXT]
            else:
                nodes[previous, NEXT] = nodes[child, NEXT]
            if nodes[node, LAST] == child:
                nodes[node, LAST] = previous
            top = 0
            stack[top] = child
            top += 1
            while top > 0:
                top -= 1
                gone = stack[top]
                key = _key(nodes[gone, PARENT], nodes[gone, TOKEN])
                keys[_slot(keys, key)] = TOMBSTONE
                below = nodes[gone, FIRST]
                while below >= 0:
                    if top == stack.shape[0]:
                        grown = np.empty(2 * top, np.int64)
                        grown[:top] = stack
                        stack = grown
                    stack[top] = below
                    top += 1
                    below = nodes[below, NEXT]
                free[meta[FREE]] = gone
                meta[FREE] += 1
            break


@njit(cache=True)
def _rehash(keys, values, new_keys, new_values):  # pragma: no cover - compiled
    for slot in range(keys.shape[0]):
        if keys[slot] >= 0:
            index = _slot(new_keys, keys[slot])
            new_keys[index] = keys[slot]
            new_values[index] = values[slot]


@njit(cache=True)
def _best_first(nodes, start, max_nodes, min_prob, out_tokens, out_parents,
                out_probs):  # pragma: no cover - compiled
    """Grow a tree below `start` by the probability of each path, most probable first (ties: the earlier pushed),
    until `max_nodes` nodes or no candidate reaches `min_prob` -> (nodes taken, the sum of their probabilities);
    out_probs: each node's path probability."""
    capacity = 64
    cand_node = np.empty(capacity, np.int64)
    cand_prob = np.empty(capacity, np.float64)
    cand_parent = np.empty(capacity, np.int64)
    count = 0
    taken = 0
    score = 0.0
    parent_node, parent_prob, parent_index = start, 1.0, -1
    while True:
        total = 0
        child = nodes[parent_node, FIRST]
        while child >= 0:
            total += nodes[child, COUNT]
            child = nodes[child, NEXT]
        child = nodes[parent_node, FIRST]
        while child >= 0 and total > 0:
            prob = parent_prob * nodes[child, COUNT] / total
            if prob >= min_prob:
                if count == capacity:
                    capacity *= 2
                    grown_node = np.empty(capacity, np.int64)
                    grown_prob = np.empty(capacity, np.float64)
                    grown_parent = np.empty(capacity, np.int64)
                    grown_node[:count] = cand_node[:count]
                    grown_prob[:count] = cand_prob[:count]
                    grown_parent[:count] = cand_parent[:count]
                    cand_node, cand_prob, cand_parent = grown_node, grown_prob, grown_parent
                cand_node[count] = child
                cand_prob[count] = prob
                cand_parent[count] = parent_index
                count += 1
            child = nodes[child, NEXT]
        if taken >= max_nodes:
            break
        best = -1
        for index in range(count):
            if cand_prob[index] >= 0.0 and (best < 0 or cand_prob[index] > cand_prob[best]):
                best = index
        if best < 0:
            break
        out_tokens[taken] = nodes[cand_node[best], TOKEN]
        out_parents[taken] = cand_parent[best]
        out_probs[taken] = cand_prob[best]
        score += cand_prob[best]
        parent_node, parent_prob, parent_index = cand_node[best], cand_prob[best], taken
        cand_prob[best] = -1.0  # taken
        taken += 1
    return taken, score


@njit(cache=True)
def _budget(length, max_tokens, factor):  # pragma: no cover - compiled
    """The most nodes a draft from a held suffix of `length` tokens may take: factor x length, within max_tokens."""
    return min(max_tokens, int(np.floor(factor * length)))


@njit(cache=True)
def _bound(length, max_tokens, factor, depth):  # pragma: no cover - compiled
    """The most a held suffix of `length` tokens can score: its budget, and the depths below it (nodes at one depth
    are exclusive continuations: their path probabilities sum to at most 1)."""
    return min(_budget(length, max_tokens, factor), depth - length)


@njit(cache=True)
def _walk(table, node, tokens):  # pragma: no cover - compiled
    """The node that `tokens` lead to from `node` (table: the hash table, [slots, (key, child)]), or -1 where the
    tree does not hold the path."""
    keys = table[:, 0]
    for token in tokens:
        key = _key(node, token)
        slot = _slot(keys, key)
        if keys[slot] != key:
            return -1
        node = table[slot, 1]
    return node


@njit(cache=True)
def _lookup(table, cursor_nodes, start, pending, length):  # pragma: no cover - compiled
    """The node of a `_draft` candidate: pending from the cursor's held suffix `start`, or pending's last `length`
    tokens from the root (start -1); -1 where the tree does not hold it."""
    if start >= 0:
        return _walk(table, cursor_nodes[start], pending)
    return _walk(table, ROOT, pending[pending.shape[0] - length:])


@njit(cache=True)
def _candidates(cursor, extra, depth):  # pragma: no cover - compiled
    """The suffixes a draft may start from, once the cursor's sequence is followed by `extra` more tokens: what
    `_advance` by them would hold if the tree held them all, longest first -> (lengths, starts), starts the held
    suffix's index in the cursor that each extends, or -1 for a suffix of the extra tokens alone."""
    cursor_lengths, cursor_size = _held(cursor)[1], cursor[0]
    lengths = np.empty(cursor_size + min(extra, depth), np.int64)
    starts = np.empty(lengths.shape[0], np.int64)
    count = 0
    for index in range(cursor_size):
        if cursor_lengths[index] + extra <= depth:  # (`_advance` drops a suffix at the depth)
            lengths[count] = cursor_lengths[index] + extra
            starts[count] = index
            count += 1
    for length in range(min(extra, depth), 0, -1):
        lengths[count] = length
        starts[count] = -1
        count += 1
    return lengths[:count], starts[:count]


@njit(cache=True)
def _draft(tree, cursor, pending, limits, out):  # pragma: no cover - compiled
    """The best tree over the suffixes the tree holds of the cursor's sequence followed by `pending` (see the
    module's docstring) into out = (tokens, parents, probs): the highest score, the longest suffix of equal scores
    -> (nodes, match length, score). The suffixes are searched by what they can score, most first, and the search
    ends where none left can win (a match near half the depth can score the most). A suffix's node is looked up
    only when the search reaches it: `pending` from the node of a held suffix (or from the root, for a suffix of
    pending alone), which is what `_advance` by `pending` would hold, in the same order (longest first).
    tree: `SuffixTree.view`; cursor: `Cursor.state`; limits: (max_tokens, factor, min_prob)."""
    nodes, table, depth, bisects = tree
    cursor_nodes = _held(cursor)[0]
    max_tokens, factor, min_prob = limits
    out_tokens, out_parents, out_probs = out
    lengths, starts = _candidates(cursor, pending.shape[0], depth)
    count = lengths.shape[0]
    best_taken, best_length, best_score = 0, 0, 0.0
    tokens = np.empty(max(max_tokens, 1), np.int64)
    parents = np.empty(max(max_tokens, 1), np.int64)
    probs = np.empty(max(max_tokens, 1), np.float64)
    bounds = np.empty(count, np.int64)
    for index in range(count):
        bounds[index] = _bound(lengths[index], max_tokens, factor, depth)
    # The tree lacks every candidate before `held` (it lacks a suffix of each: they are longer). Past the first
    # miss, bisection finds the first candidate it holds (node `held_node`): it holds every shorter one too. Not once
    # a sequence was removed: a cursor may then hold a freed node, reused for another path, and a lookup through it
    # may find what the tree does not hold.
    held, held_node = 0, -1
    for _ in range(count):
        pick = -1  # the highest bound left, the longest of equal bounds
        for index in range(count):
            if bounds[index] >= 0 and (pick < 0 or bounds[index] > bounds[pick]):
                pick = index
        if pick < 0 or bounds[pick] < best_score or bounds[pick] <= 0:
            break  # nothing left can score more (nor tie the best from a longer suffix: those came first)
        bound, length = bounds[pick], lengths[pick]
        bounds[pick] = -1
        if (bound == best_score and length < best_length) or pick < held:
            continue
        node = held_node if pick == held and held_node >= 0 else _lookup(table, cursor_nodes, starts[pick], pending,
                                                                         length)
        if node < 0 and bisects:  # the longest candidate held lies past `pick`
            low, high = pick + 1, count  # held is in [low, high] (count: none is held)
            while low < high:
                middle = (low + high) // 2
                found = _lookup(table, cursor_nodes, starts[middle], pending, lengths[middle])
                if found >= 0:
                    high, held_node = middle, found
                else:
                    low = middle + 1
            held = low
        if node < 0 or nodes[node, FIRST] < 0:
            continue
        taken, score = _best_first(nodes, node, _budget(length, max_tokens, factor), min_prob, tokens, parents,
                                   probs)
        if score > best_score or (score == best_score and score > 0 and length > best_length):
            best_taken, best_length, best_score = taken, length, score
            out_tokens[:taken] = tokens[:taken]
            out_parents[:taken] = parents[:taken]
            out_probs[:taken] = probs[:taken]
    return best_taken, best_length, best_score


@njit(cache=True)
def _held(state):  # pragma: no cover - compiled
    """A `Cursor.state`'s parts: (nodes, lengths, size), views of it."""
    slots = (state.shape[0] - 1) // 2
    return state[1: 1 + slots], state[1 + slots:], state[:1]


@njit(cache=True)
def _draft_pair(tree, cursor, other_tree, other_cursor, other, pending, limits, out_ids,
                out_probs):  # pragma: no cover - compiled
    """`_draft` on this tree, then on the other (where `other`) into the outs' row 1, searched only where one of its
    suffixes could beat this one's score (`_bound`) -> (nodes, match length, score, 1 where the other's won), the
    winner in the outs' row 0. One compiled call for a row's step, its arguments few arrays (each costs the call
    its unboxing).
    trees: `SuffixTree.view`s; cursors: `Cursor.state`s; limits: (max_tokens, factor, min_prob); out_ids: [2, 2,
    width] (tokens, parents) a row; out_probs: [2, width]."""
    other_depth = other_tree[2]
    max_tokens, factor = limits[0], limits[1]
    taken, length, score = _draft(tree, cursor, pending, limits, (out_ids[0, 0], out_ids[0, 1], out_probs[0]))
    if not other:
        return taken, length, score, 0
    most = 0  # the most the other tree's draft can score
    for candidate in _candidates(other_cursor, pending.shape[0], other_depth)[0]:
        most = max(most, _bound(candidate, max_tokens, factor, other_depth))
    if most <= score:
        return taken, length, score, 0
    got, got_length, got_score = _draft(other_tree, other_cursor, pending, limits,
                                        (out_ids[1, 0], out_ids[1, 1], out_probs[1]))
    if got_score <= score:
        return taken, length, score, 0
    out_ids[0, :, :got] = out_ids[1, :, :got]
    out_probs[0, :got] = out_probs[1, :got]
    return got, got_length, got_score, 1


class Cursor:
    """A sequence being matched against (and, for `SuffixTree.extend`, added to) a tree: the nodes of its suffixes
    that the tree holds, longest first, with their lengths."""

    __slots__ = ("state", "nodes", "lengths", "size", "arrays")

    def __init__(self, depth: int):
        # One array (a draft's kernel unboxes one argument, not three): [size, nodes..., lengths...]
        self.state = np.zeros(1 + 2 * (depth + 1), np.int64)
        self.size, self.nodes, self.lengths = self.state[:1], self.state[1: depth + 2], self.state[depth + 2:]
        self.arrays = (self.nodes, self.lengths, self.size)  # the appending kernels' view (built once: a row's step)

    @property
    def matched(self) -> list[tuple[int, int]]:
        """(node, length) of each held suffix, longest first."""
        count = int(self.size[0])
        return list(zip(self.nodes[:count].tolist(), self.lengths[:count].tolist()))


@dataclass(eq=False, slots=True)  # (not frozen: a frozen dataclass sets each field through object.__setattr__)
class TreeDraft:
    tokens: list[int]
    parents: list[int]  # parents[i]: index of token i's parent (-1 = the row's last token); parents first
    match_length: int  # of the suffix the tree continues (0: nothing matched)
    score: float  # sum of the nodes' path probabilities: the tokens a greedy verifier is expected to accept
    probs: list[float] = field(default_factory=list)  # each node's path probability (non-increasing: best first)


class SuffixTree:
    def __init__(self, depth: int = 24, capacity: int = 1024):
        """capacity: nodes held before the tables grow (`for_tokens` sizes it for a known sequence length)."""
        if depth < 1:
            raise ValueError(f"a suffix tree needs depth >= 1, got {depth}")
        capacity = max(capacity, 2)
        self.depth = depth
        self.tokens = 0  # tokens indexed
        self.nodes = np.full((capacity, 6), -1, np.int32)  # [rows, TOKEN..PARENT]; row 0 is the root
        self.nodes[ROOT, COUNT] = 0
        self.free = np.zeros(capacity, np.int32)  # rows freed by `remove`, reused first
        self.meta = np.array([1, 0, 0, 0], np.int64)  # USED, FREE, FILLED, TOUCHED
        self.table = _hash_table(1 << (2 * capacity - 1).bit_length())  # (a power of two)
        self.keys, self.values = self.table[:, 0], self.table[:, 1]
        self.removed = 0  # sequences `remove`d so far
        self._out: tuple[np.ndarray, np.ndarray] | None = None  # best_draft's (ids [2, 2, width], probs [2, width])
        self.arrays = self._arrays()  # the compiled kernels' view of the tables, until they grow
        self.view = self._view()  # the drafting kernels' (`_draft`)

    @classmethod
    def for_tokens(cls, tokens: int, depth: int = 24) -> "SuffixTree":
        """A tree with room for a sequence of `tokens` tokens (each adds at most `depth` nodes): one that indexes a
        row's prompt and output never grows while the row decodes, where a growth copies its tables."""
        return cls(depth, capacity=1 + tokens * depth)

    @property
    def node_count(self) -> int:
        return int(self.meta[USED] - self.meta[FREE] - 1)

    @property
    def nbytes(self) -> int:
        return self.nodes.nbytes + self.free.nbytes + self.table.nbytes

    def cursor(self, tokens: Iterable[int] = ()) -> Cursor:
        """A cursor that has matched `tokens` (without adding them)."""
        cursor = Cursor(self.depth)
        self.advance(cursor, tokens)
        return cursor

    def advance(self, cursor: Cursor, tokens: Iterable[int] | int) -> None:
        ids = _ids(tokens)
        if len(ids):
            _advance(self.nodes, self.keys, self.values, self.meta, self.free, cursor.nodes, cursor.lengths,
                     cursor.size, ids, self.depth)

    def extend(self, cursor: Cursor, tokens: Iterable[int]) -> None:
        """Add tokens to the sequence `cursor` indexes: every suffix of it (up to `depth` tokens) now ends with each
        new token in turn, and counts once more. The cursor then holds all of them."""
        ids = _ids(tokens)
        for start in range(0, len(ids), APPEND_CHUNK):  # room reserved for the worst case of a chunk at a time
            chunk = ids[start: start + APPEND_CHUNK]
            self._reserve(len(chunk) * self.depth)
            _append(self.nodes, self.keys, self.values, self.meta, self.free, cursor.nodes, cursor.lengths,
                    cursor.size, chunk, self.depth)
        self.tokens += len(ids)

    def best_draft(self, cursor: Cursor, pending: Sequence[int], limits: tuple[int, float, float],
                   other: "SuffixTree | None" = None, other_cursor: Cursor | None = None) -> tuple[TreeDraft, bool]:
        """`draft` from the cursor's sequence followed by `pending` on this tree and on `other` (with its cursor),
        the better of the two (this tree's on a tie), in one compiled call; limits: (max_tokens, factor, min_prob)
        -> (the draft, whether it is the other tree's)."""
        ids = _ids(pending)
        max_tokens, factor, min_prob = limits
        width = max(max_tokens, 1)
        if self._out is None or self._out[1].shape[1] < width:
            self._out = (np.empty((2, 2, width), np.int64), np.empty((2, width)))
        out_ids, out_probs = self._out
        second, second_cursor = (other, other_cursor) if other is not None else (self, cursor)
        taken, length, score, swapped = _draft_pair(
            self.view, cursor.state, second.view, second_cursor.state, other is not None, ids,
            (max(max_tokens, 0), float(factor), float(min_prob)), out_ids, out_probs)
        draft = TreeDraft(out_ids[0, 0, :taken].tolist(), out_ids[0, 1, :taken].tolist(), int(length), float(score),
                          out_probs[0, :taken].tolist())
        return draft, bool(swapped)

    def _arrays(self) -> tuple:
        """The compiled kernels' view of the tree: (nodes, keys, values, meta, free)."""
        return self.nodes, self.keys, self.values, self.meta, self.free

    def _view(self) -> tuple:
        """The drafting kernels' view: (nodes, table, depth, whether a draft may bisect). Not once a sequence was
        removed: a cursor may then hold a freed node, reused for another path, and a lookup through it may find what
        the tree does not hold (`_draft`)."""
        return self.nodes, self.table, self.depth, self.removed == 0

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back one sequence that `extend` added from a fresh cursor (eviction)."""
        ids = _ids(tokens)
        if len(ids):
            _remove(self.nodes, self.keys, self.values, self.meta, self.free, ids, self.depth)
            self.removed += 1
            self.view = self._view()
        self.tokens -= len(ids)

    def draft(self, cursor: Cursor, max_tokens: int, factor: float = 1.0, min_prob: float = 0.1,
              pending: Sequence[int] = ()) -> TreeDraft:
        """The draft from the cursor's sequence followed by `pending` (tokens the cursor has not matched)."""
        ids = _ids(pending)
        if int(cursor.size[0]) + len(ids) == 0 or max_tokens <= 0:
            return TreeDraft([], [], 0, 0.0)
        tokens = np.empty(max_tokens, np.int64)
        parents = np.empty(max_tokens, np.int64)
        probs = np.empty(max_tokens, np.float64)
        taken, length, score = _draft(self.view, cursor.state, ids, (max_tokens, float(factor), float(min_prob)),
                                      (tokens, parents, probs))
        return TreeDraft(tokens[:taken].tolist(), parents[:taken].tolist(), int(length), float(score),
                         probs[:taken].tolist())

    # ------------------------------------------------------------------------------------------- inspection
    def node(self, path: Sequence[int]) -> int | None:
        """The node of a token path from the root, or None when the tree does not hold it."""
        node = ROOT
        for token in path:
            node = int(_child(self.nodes, self.keys, self.values, self.meta, self.free, node, token, False))
            if node < 0:
                return None
        return node

    def count(self, node: int) -> int:
        return int(self.nodes[node, COUNT])

    def children(self, node: int) -> dict[int, int]:
        """token -> child node, in the order they first occurred."""
        out, child = {}, int(self.nodes[node, FIRST])
        while child >= 0:
            out[int(self.nodes[child, TOKEN])] = child
            child = int(self.nodes[child, NEXT])
        return out

    def best_first_tree(self, start: int, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], float]:
        """The draft tree below node `start` (see `_best_first`) -> (tokens, parents, score)."""
        tokens = np.empty(max(max_nodes, 1), np.int64)
        parents = np.empty(max(max_nodes, 1), np.int64)
        probs = np.empty(max(max_nodes, 1), np.float64)
        taken, score = _best_first(self.nodes, start, max_nodes, float(min_prob), tokens, parents, probs)
        return tokens[:taken].tolist(), parents[:taken].tolist(), float(score)

    # ------------------------------------------------------------------------------------------- growth
    def _reserve(self, new_nodes: int) -> None:
        """Room for `new_nodes` more nodes (the most an append of them can create) and their hash entries, the hash
        table kept at most half full."""
        used, _, filled, _ = self.meta.tolist()  # (Python ints: cheaper than numpy scalars)
        needed, grown_tables = used + new_nodes, False
        if needed > len(self.nodes):
            grown_tables = True
            rows = max(needed, 2 * len(self.nodes))
            grown = np.full((rows, 6), -1, np.int32)
            grown[: len(self.nodes)] = self.nodes
            self.nodes = grown
            free = np.zeros(rows, np.int32)
            free[: len(self.free)] = self.free
            self.free = free
        filled += new_nodes
        if 2 * filled > len(self.keys):
            grown_tables = True
            live = self.node_count + new_nodes
            slots = len(self.keys)
            while slots < 3 * live:  # (grown again at half full)
                slots *= 2
            table = _hash_table(slots)
            _rehash(self.keys, self.values, table[:, 0], table[:, 1])
            self.table, self.keys, self.values = table, table[:, 0], table[:, 1]
            self.meta[FILLED] = self.node_count  # tombstones are gone
        if grown_tables:  # (the kernels' views still hold the old tables)
            self.arrays, self.view = self._arrays(), self._view()


def _hash_table(slots: int) -> np.ndarray:
    """[slots, (key, value)]: keys (parent << 24 | token) and values (the child node) in one table, so a probe's key
    and value share a cache line (the kernels take its columns as keys and values)."""
    table = np.zeros((slots, 2), np.int64)
    table[:, 0] = EMPTY
    return table


def _ids(tokens: Iterable[int] | int) -> np.ndarray:
    if isinstance(tokens, (int, np.integer)):
        tokens = [tokens]
    if isinstance(tokens, np.ndarray):
        ids = tokens.astype(np.int64, copy=False)
        low, high = (int(ids.min()), int(ids.max())) if len(ids) else (0, 0)
    else:  # a step's few tokens: Python's min and max, cheaper than two numpy reductions
        if not isinstance(tokens, list):
            tokens = list(tokens)
        ids = np.array(tokens, dtype=np.int64)
        low, high = (min(tokens), max(tokens)) if tokens else (0, 0)
    if low < 0 or high >= MAX_TOKEN:
        raise ValueError(f"token ids must be within [0, {MAX_TOKEN}) for a suffix tree")
    return ids


def index_sequences(sequences: Iterable[Sequence[int]], depth: int = 24) -> SuffixTree:
    """A tree over whole sequences (each indexed from its own start: no suffix crosses two of them)."""
    tree = SuffixTree(depth)
    for sequence in sequences:
        tree.extend(tree.cursor(), sequence)
    return tree
