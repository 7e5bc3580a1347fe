"""The speculation budget's per-row arithmetic for a step's plan, compiled: what each row's first n draft nodes are
expected to add (`expected_gains`) and where a row's draft stops paying (`cuts`). A step of 64 rows with drafts
of ~16 nodes ran these as Python loops on every step, time a GPU's step waits for (issue 50).

The arithmetic is the budget's own, operation for operation (the same float sums in the same order), so a plan is
the same bit for bit as the Python loops gave.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from ..kernels.numba_kernels import use_numba_cache

use_numba_cache()
from numba import njit  # noqa: E402  (after the cache directory is set)


class Deepening:
    """Per row, the draft nodes that deepen the path its draft can accept and what each adds, in order: node n
    (1-based) in `nodes[r, :counts[r]]`, its expected tokens in `adds[r, :counts[r]]`."""

    __slots__ = ("nodes", "adds", "counts")

    def __init__(self, nodes: np.ndarray, adds: np.ndarray, counts: np.ndarray):
        self.nodes, self.adds, self.counts = nodes, adds, counts

    def rows(self) -> list[list[tuple[int, float]]]:
        """[(n, what node n adds), ...] per row (what the Python loops built)."""
        return [list(zip(self.nodes[r, :c].tolist(), self.adds[r, :c].tolist()))
                for r, c in enumerate(self.counts.tolist())]


def expected_gains(reaches: list[list[int]], rates: list[float], longest: int,
                   confidences: list[list[float] | None] | None = None) -> tuple[np.ndarray, Deepening]:
    """gained [R, longest + 1]: gained[r, n] = expected tokens row r's first n nodes add (a node adds rate^depth when
    it deepens the path its draft can accept, nothing otherwise; with a confidence long enough, its own), each row's
    last sum repeated past its nodes; and the deepening nodes. reaches[r][n - 1]: the deepest path row r's draft
    cut to n nodes can accept."""
    rows = len(reaches)
    reach_ends = np.cumsum([len(r) for r in reaches], dtype=np.int64) if rows else np.zeros(0, np.int64)
    reach_flat = np.fromiter(chain.from_iterable(reaches), np.int64, int(reach_ends[-1]) if rows else 0)
    if confidences is None:
        confidences = [None] * rows
    # A row's confidence counts where it covers the nodes the plan may verify; -1: the row has none that does.
    lengths = [len(c) if c is not None and len(c) >= min(len(r), longest) else -1
               for c, r in zip(confidences, reaches)]
    confidence_ends = np.cumsum([max(n, 0) for n in lengths], dtype=np.int64) if rows else np.zeros(0, np.int64)
    confidence_flat = np.fromiter(chain.from_iterable(c for c, n in zip(confidences, lengths) if n >= 0),
                                  np.float64, int(confidence_ends[-1]) if rows else 0)
    gained, nodes, adds, counts = _gains(reach_flat, reach_ends, np.asarray(rates, np.float64), confidence_flat,
                                         confidence_ends, np.asarray(lengths, np.int64), longest)
    return gained, Deepening(nodes, adds, counts)


def cuts(deepening: Deepening, bar: float) -> list[int]:
    """Per row, the most nodes worth verifying: up to the last node that deepens its path by at least `bar`."""
    return _cuts(deepening.nodes, deepening.adds, deepening.counts, float(bar)).tolist()


@njit(cache=True)
def _gains(reach_flat, reach_ends, rates, confidence_flat, confidence_ends, confidence_lengths,
           longest):  # pragma: no cover - compiled
    rows = rates.shape[0]
    gained = np.empty((rows, longest + 1))
    nodes = np.zeros((rows, max(longest, 1)), np.int64)
    adds = np.zeros((rows, max(longest, 1)))
    counts = np.zeros(rows, np.int64)
    for row in range(rows):
        start = reach_ends[row - 1] if row > 0 else 0
        taken = min(reach_ends[row] - start, longest)
        gained[row, 0] = 0.0
        count = 0
        if confidence_lengths[row] >= 0:
            at = confidence_ends[row - 1] if row > 0 else 0
            for n in range(1, taken + 1):
                chance = confidence_flat[at + n - 1]
                gained[row, n] = gained[row, n - 1] + chance
                nodes[row, count] = n
                adds[row, count] = chance
                count += 1
        else:
            total, depth, power, rate = 0.0, 0, 1.0, rates[row]
            for n in range(1, taken + 1):
                deepest = reach_flat[start + n - 1]
                if deepest > depth:
                    depth, power = deepest, power * rate
                    total += power
                    nodes[row, count] = n
                    adds[row, count] = power
                    count += 1
                gained[row, n] = total
        counts[row] = count
        for n in range(taken + 1, longest + 1):
            gained[row, n] = gained[row, taken]
    return gained, nodes, adds, counts


@njit(cache=True)
def _cuts(nodes, adds, counts, bar):  # pragma: no cover - compiled
    out = np.zeros(counts.shape[0], np.int64)
    for row in range(counts.shape[0]):
        cut = 0
        for index in range(counts[row]):
            if adds[row, index] < bar:
                break
            cut = nodes[row, index]
        out[row] = cut
    return out
