"""The speculation budget's per-row arithmetic for a step's plan: what each row's first n draft nodes are expected to
add (`expected_gains`) and where a row's draft stops paying (`cuts`). Compiled where numba compiles: as Python loops
over every row's nodes they ran on every step, time a GPU's step waits for (issue 50; decisions.md, session 29).

The compiled arithmetic is the Python loops' operation for operation (the same float sums in the same order), so a
plan is the same bit for bit on either path.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from ..kernels.numba_kernels import LazyKernel


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
    compiled = kernels()
    if confidences is None:
        confidences = [None] * len(reaches)
    if compiled is None:
        return python_gains(reaches, rates, longest, confidences)
    rows = len(reaches)
    reach_ends = np.cumsum([len(r) for r in reaches], dtype=np.int64) if rows else np.zeros(0, np.int64)
    reach_flat = np.fromiter(chain.from_iterable(reaches), np.int64, int(reach_ends[-1]) if rows else 0)
    # A row's confidence counts where it covers the nodes the plan may verify; -1: the row has none that does.
    lengths = [len(c) if c is not None and len(c) >= min(len(r), longest) else -1
               for c, r in zip(confidences, reaches)]
    confidence_ends = np.cumsum([max(n, 0) for n in lengths], dtype=np.int64) if rows else np.zeros(0, np.int64)
    confidence_flat = np.fromiter(chain.from_iterable(c for c, n in zip(confidences, lengths) if n >= 0),
                                  np.float64, int(confidence_ends[-1]) if rows else 0)
    gained, nodes, adds, counts = compiled[0](reach_flat, reach_ends, np.asarray(rates, np.float64),
                                              confidence_flat, confidence_ends, np.asarray(lengths, np.int64),
                                              longest)
    return gained, Deepening(nodes, adds, counts)


def cuts(deepening: Deepening, bar: float) -> list[int]:
    """Per row, the most nodes worth verifying: up to the last node that deepens its path by at least `bar`."""
    compiled = kernels()
    if compiled is None:
        return [_python_cut(steps, bar) for steps in deepening.rows()]
    return compiled[1](deepening.nodes, deepening.adds, deepening.counts, float(bar)).tolist()


def best_width(caps: np.ndarray, gained: np.ndarray, counted: int, slopes: tuple[float, float] | None,
               scale: float, computed_share: float | None) -> tuple[int, float]:
    """The best of the plans where row r drafts min(caps[r], w - 1) nodes, over the widths w = 2 .. max(caps) + 1
    -> (w - 1 of the best, the first of equal values, and its value: expected tokens over its cost in plain steps).
    caps [R] (each <= gained's last column), gained [R, longest + 1] (expected_gains). A step costs 1 + s_token x
    (computed - R) / R + s_width x (w - 1) plain steps, times `scale` (the clock's penalty); `computed_share`: the
    forward computes the real tokens where they are at most this share of the padded block (ragged), else the padded
    block; None: always the padded block. slopes None (a fixed cost function), or no numba: (-1, 0.0), and the
    caller plans in numpy."""
    compiled = kernels()
    if compiled is None or slopes is None:
        return -1, 0.0
    share = -1.0 if computed_share is None else float(computed_share)
    top, value = compiled[2](caps, gained, float(counted), float(slopes[0]), float(slopes[1]), float(scale), share)
    return int(top), float(value)


def python_gains(reaches: list[list[int]], rates: list[float], longest: int,
                 confidences: list[list[float] | None]) -> tuple[np.ndarray, Deepening]:
    """`expected_gains` in Python loops: where numba does not compile (and what the compiled path must equal)."""
    rows = len(reaches)
    gained = np.empty((rows, longest + 1))
    width = max(longest, 1)
    deepening = Deepening(np.zeros((rows, width), np.int64), np.zeros((rows, width)), np.zeros(rows, np.int64))
    for row, (reach, rate, confidence) in enumerate(zip(reaches, rates, confidences)):
        if confidence is not None and len(confidence) >= min(len(reach), longest):
            sums, steps = [0.0], []
            for n, chance in enumerate(confidence[:min(len(reach), longest)], start=1):
                sums.append(sums[-1] + chance)
                steps.append((n, chance))
        else:
            total, depth, power, sums, steps = 0.0, 0, 1.0, [0.0], []
            for n, deepest in enumerate(reach[:longest], start=1):
                if deepest > depth:
                    depth, power = deepest, power * rate
                    total += power
                    steps.append((n, power))
                sums.append(total)
        gained[row, :len(sums)] = sums
        gained[row, len(sums):] = sums[-1]
        deepening.counts[row] = len(steps)
        for index, (n, add) in enumerate(steps):
            deepening.nodes[row, index], deepening.adds[row, index] = n, add
    return gained, deepening


def _python_cut(steps: list[tuple[int, float]], bar: float) -> int:
    cut = 0
    for n, gain in steps:
        if gain < bar:
            break
        cut = n
    return cut


def _compile():
    from numba import njit

    @njit(cache=True)
    def gains(reach_flat, reach_ends, rates, confidence_flat, confidence_ends, confidence_lengths,
              longest):  # pragma: no cover - compiled
        """python_gains over flat arrays: row r's reach is reach_flat[reach_ends[r - 1]:reach_ends[r]], its
        confidence likewise (confidence_lengths[r] < 0: none that counts)."""
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
    def row_cuts(nodes, adds, counts, bar):  # pragma: no cover - compiled
        out = np.zeros(counts.shape[0], np.int64)
        for row in range(counts.shape[0]):
            cut = 0
            for index in range(counts[row]):
                if adds[row, index] < bar:
                    break
                cut = nodes[row, index]
            out[row] = cut
        return out

    @njit(cache=True)
    def widest_best(caps, gained, counted, token, per_width, scale, share):  # pragma: no cover - compiled
        """best_width in loops, the numpy version's float operations in its order: a width's tokens summed over
        the rows in order, then added to `counted`."""
        rows = caps.shape[0]
        top = 0
        for row in range(rows):
            top = max(top, caps[row])
        best, best_value = -1, 0.0
        for nodes in range(1, top + 1):
            total, real = 0.0, rows
            for row in range(rows):
                take = min(caps[row], nodes)
                total = total + gained[row, take] if row > 0 else gained[row, take]
                real += take
            width = nodes + 1
            padded = rows * width
            computed = real if share >= 0.0 and real <= share * padded else padded
            ratio = (1.0 + token * (computed - rows) / rows + per_width * (width - 1)) * scale
            value = (counted + total) / ratio
            if best < 0 or value > best_value:
                best, best_value = nodes, value
        return best, best_value

    return gains, row_cuts, widest_best


kernels = LazyKernel(_compile, "the compiled plan arithmetic", "; the budget plans in Python loops")
