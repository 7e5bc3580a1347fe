"""A step's `suffix` proposals drafted together: every row's new tokens into its own tree and its job-memory cursor,
then its draft, in one compiled call over the rows (suffix_batch_kernel.py), spread over threads where the batch is
large. Row by row, each proposal paid its own dispatch and Python around the same compiled work; on a GPU actor the
device waits for all of them each step (docs/decisions.md).

The drafts are the ones each row's `SuffixDrafter.propose` gives alone (tests/specdec_core/test_suffix_batch.py).
Where numba cannot compile the pass, there is no batch: each row proposes alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..kernels.numba_kernels import LazyKernel, use_torch_threads
from . import suffix_batch_kernel  # (numba is imported already: suffix_tree's kernels)
from .base import EMPTY_SOURCE, Draft, DraftPool
from .suffix_tree import Cursor, SuffixTree

if TYPE_CHECKING:
    from .suffix import SuffixDrafter

SUFFIX_SOURCE = "suffix"  # drafted from the request's own tree
MEMORY_SOURCE = "memory"  # drafted from the job memory's
PARALLEL_MIN_ROWS = 8  # fewer rows than this do not pay for a parallel region


def _compile():
    return (suffix_batch_kernel.extend_and_draft_rows, suffix_batch_kernel.extend_and_draft_rows_parallel,
            suffix_batch_kernel.empty_lists)


kernels = LazyKernel(_compile, "compiled suffix proposals of many rows", "; each suffix row proposes alone")


class SuffixBatch(DraftPool):
    """The `suffix` rows of one decoder with one job memory and one set of options. Each row holds a slot: its
    tree's and cursors' arrays sit at that index of typed lists the compiled pass reads."""

    fills_before_plan = True

    def __init__(self, memory, options: tuple[float, float, int], lists: tuple):
        self.memory = memory  # JobMemory or None
        self.factor, self.min_prob, self.depth = options
        self.trees, self.cursors, self.memory_cursors = lists
        self.owners: list[SuffixDrafter | None] = []  # slot -> its drafter
        self.free_slots: list[int] = []
        self.pending: list[tuple[SuffixDrafter, list[int], int, Draft]] = []
        self._idle = SuffixTree(self.depth, capacity=2)  # what a free slot holds (a retired row's tables are freed)
        self._idle_cursor = Cursor(self.depth)

    @classmethod
    def shared(cls, pools: dict, drafter: "SuffixDrafter") -> "SuffixBatch | None":
        """The decoder's batch for this drafter's memory and options (made on first use); None without numba."""
        compiled = kernels()
        if compiled is None:
            return None
        options = (drafter.factor, drafter.min_prob, drafter.depth)
        key = (cls, id(drafter.memory), options)
        batch = pools.get(key)
        if batch is None or batch.memory is not drafter.memory:
            batch = pools[key] = cls(drafter.memory, options, compiled[2]())
        return batch

    # ------------------------------------------------------------------------------------------- slots
    def attach(self, drafter: "SuffixDrafter") -> int:
        slot = self.free_slots.pop() if self.free_slots else len(self.owners)
        if slot == len(self.owners):
            self.owners.append(drafter)
            for items, array in zip(self._lists(), self._arrays(drafter)):
                items.append(array)
        else:
            self.owners[slot] = drafter
            self._set(slot, drafter)
        return slot

    def refresh(self, drafter: "SuffixDrafter") -> None:
        """The drafter's tree grew: its slot takes the new tables."""
        self._set(drafter.slot, drafter)

    def release(self, drafter: "SuffixDrafter") -> None:
        slot = drafter.slot
        if slot is None or self.owners[slot] is not drafter:
            return
        self.owners[slot] = None
        self._set(slot, None)
        self.free_slots.append(slot)
        self.pending = [ask for ask in self.pending if ask[0] is not drafter]

    def _lists(self) -> tuple:
        return (*self.trees, *self.cursors, *self.memory_cursors)

    def _arrays(self, drafter: "SuffixDrafter | None") -> tuple:
        tree, cursor = (drafter.own, drafter.own_cursor) if drafter is not None else (self._idle, self._idle_cursor)
        memory_cursor = drafter.memory_cursor if drafter is not None and drafter.memory is not None else None
        memory_cursor = memory_cursor or self._idle_cursor
        return (*tree._arrays(), cursor.nodes, cursor.lengths, cursor.size, memory_cursor.nodes,
                memory_cursor.lengths, memory_cursor.size)

    def _set(self, slot: int, drafter: "SuffixDrafter | None") -> None:
        for items, array in zip(self._lists(), self._arrays(drafter)):
            items[slot] = array

    # ------------------------------------------------------------------------------------------- drafting
    def ask(self, drafter: "SuffixDrafter", new: list[int], max_tokens: int) -> Draft:
        """A draft after the row's `new` tokens (already checked and room made for them), filled by flush()."""
        draft = Draft(tokens=[], source=EMPTY_SOURCE)
        self.pending.append((drafter, new, max(max_tokens, 0), draft))
        return draft

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        if not pending:
            return
        serial, parallel, _ = kernels()
        tokens, offsets, slots, limits = [], [0], [], []
        for drafter, new, max_tokens, _ in pending:
            tokens += new
            offsets.append(len(tokens))
            slots.append(drafter.slot)
            limits.append(max_tokens)
        rows = len(pending)
        shape = (rows, 2, max(max(limits), 1))  # (fresh each step: a view of a larger buffer is typed anew)
        out = (np.empty(shape, np.int64), np.empty(shape, np.int64), np.empty(shape))
        found = np.zeros((rows, 3), np.int64)  # [K]: nodes, from the memory, a chain
        memory = self.memory
        memory_tree = memory.tree if memory is not None else self._idle
        asked = (np.array(slots, np.int64), np.array(tokens, np.int64), np.array(offsets, np.int64),
                 np.array(limits, np.int64), float(self.factor), float(self.min_prob))
        kernel = serial
        if rows >= PARALLEL_MIN_ROWS:
            use_torch_threads()
            kernel = parallel
        kernel(self.trees, self.cursors, (memory_tree._arrays(), *self.memory_cursors, memory is not None,
                                          (self.depth, memory_tree.depth)), asked, out, found)
        self._fill([ask[3] for ask in pending], found.tolist(), out)

    @staticmethod
    def _fill(drafts: Sequence[Draft], found: list, out: tuple) -> None:
        """Each draft from its row of the pass's output (trees built parents first, as Draft asks)."""
        tokens, parents, probs = (array[:, 0].tolist() for array in out)
        for k, (draft, (taken, from_memory, chain)) in enumerate(zip(drafts, found)):
            if taken:
                draft.tokens = tokens[k][:taken]
                draft.parents = None if chain else parents[k][:taken]
                draft.confidence = probs[k][:taken]
                draft.source = MEMORY_SOURCE if from_memory else SUFFIX_SOURCE
                draft.from_context = not from_memory
