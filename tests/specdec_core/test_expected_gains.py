"""The budget's compiled per-row arithmetic (expected_gains.py) against the Python loops it replaced, bit for bit."""

import random

from specdec_core.loop.draft_tree import prefix_depths
from specdec_core.loop.expected_gains import cuts, expected_gains


def reference(reaches, rates, longest, confidences):
    """The budget's former Python loops: gained[r] (a list), deepening[r] = [(n, what node n adds), ...]."""
    gained, deepening = [], []
    for row, (reach, rate) in enumerate(zip(reaches, rates)):
        confidence = confidences[row] if confidences is not None else None
        if confidence is not None and len(confidence) >= min(len(reach), longest):
            sums, steps = [0.0], []
            for n, chance in enumerate(confidence[:min(len(reach), longest)], start=1):
                sums.append(sums[-1] + chance)
                steps.append((n, chance))
            gained.append(sums)
            deepening.append(steps)
            continue
        total, depth, power, sums, steps = 0.0, 0, 1.0, [0.0], []
        for n, deepest in enumerate(reach[:longest], start=1):
            if deepest > depth:
                depth, power = deepest, power * rate
                total += power
                steps.append((n, power))
            sums.append(total)
        gained.append(sums)
        deepening.append(steps)
    return gained, deepening


def reference_cuts(deepening, bar):
    out = []
    for steps in deepening:
        cut = 0
        for n, gain in steps:
            if gain < bar:
                break
            cut = n
        out.append(cut)
    return out


def random_reach(rng):
    size = rng.choice([0, 1, 3, 8, 16, 30])
    if rng.random() < 0.5:
        return list(range(1, size + 1))  # a chain
    parents = [rng.randrange(-1, i) for i in range(size)]  # a tree, parents first
    return prefix_depths(parents)


def test_the_compiled_gains_and_cuts_equal_the_python_loops():
    rng = random.Random(7)
    checked_cuts = 0
    for trial in range(300):
        rows = rng.randrange(1, 70)
        reaches = [random_reach(rng) for _ in range(rows)]
        longest = max(1, min(max(len(r) for r in reaches), rng.choice([4, 8, 16, 64])))
        rates = [rng.random() for _ in range(rows)]
        confidences = None if trial % 3 == 0 else [
            None if rng.random() < 0.3 else sorted((rng.random() for _ in range(rng.randrange(0, 32))), reverse=True)
            for _ in range(rows)]
        gained, deepening = expected_gains(reaches, rates, longest, confidences)
        want, want_deepening = reference(reaches, rates, longest, confidences)
        assert gained.shape == (rows, longest + 1)
        for row, sums in enumerate(want):
            assert gained[row].tolist() == sums + [sums[-1]] * (longest + 1 - len(sums)), (trial, row)
        assert deepening.rows() == want_deepening, trial
        for bar in (0.0, rng.random(), 0.5, 2.0):
            assert cuts(deepening, bar) == reference_cuts(want_deepening, bar), (trial, bar)
            checked_cuts += any(reference_cuts(want_deepening, bar))
    assert checked_cuts > 100  # bars that cut some rows and not others
