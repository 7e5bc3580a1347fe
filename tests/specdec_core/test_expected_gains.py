"""The budget's per-row plan arithmetic (expected_gains.py): its values on small drafts worked by hand, and the
compiled path equal to the Python loops bit for bit (the loops serve where numba does not compile)."""

import random

import pytest

from specdec_core.loop import expected_gains as gains_module
from specdec_core.loop.draft_tree import prefix_depths
from specdec_core.loop.expected_gains import cuts, expected_gains, python_gains


@pytest.mark.parametrize("compiled", [True, False])
def test_gains_and_cuts_of_small_drafts(compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(gains_module, "kernels", lambda: None)
    # a chain of 3 at rate 0.5; a tree whose second node is a sibling of the first (it deepens nothing); a row
    # priced by its own confidence; a row with no draft; longest 3 cuts the 4-node chain
    reaches = [[1, 2, 3], [1, 1, 2], [1, 2], [], [1, 2, 3, 4]]
    confidences = [None, None, [0.9, 0.25], None, None]
    gained, deepening = expected_gains(reaches, [0.5, 0.5, 0.1, 0.5, 0.5], 3, confidences)
    assert gained.tolist() == [[0, 0.5, 0.75, 0.875], [0, 0.5, 0.5, 0.75], [0, 0.9, 1.15, 1.15], [0, 0, 0, 0],
                               [0, 0.5, 0.75, 0.875]]
    assert deepening.rows() == [[(1, 0.5), (2, 0.25), (3, 0.125)], [(1, 0.5), (3, 0.25)], [(1, 0.9), (2, 0.25)], [],
                                [(1, 0.5), (2, 0.25), (3, 0.125)]]
    assert cuts(deepening, 0.2) == [2, 3, 2, 0, 2]  # up to the last node adding at least the bar
    assert cuts(deepening, 0.3) == [1, 1, 1, 0, 1] and cuts(deepening, 1.0) == [0] * 5


def random_reach(rng):
    size = rng.choice([0, 1, 3, 8, 16, 30])
    if rng.random() < 0.5:
        return list(range(1, size + 1))  # a chain
    return prefix_depths([rng.randrange(-1, i) for i in range(size)])  # a tree, parents first


def test_the_compiled_path_equals_the_python_loops_bit_for_bit(monkeypatch):
    rng = random.Random(7)
    checked_cuts = 0
    for trial in range(300):
        rows = rng.randrange(1, 70)
        reaches = [random_reach(rng) for _ in range(rows)]
        longest = max(1, min(max(len(r) for r in reaches), rng.choice([4, 8, 16, 64])))
        rates = [rng.random() for _ in range(rows)]
        confidences = [None] * rows if trial % 3 == 0 else [
            None if rng.random() < 0.3 else sorted((rng.random() for _ in range(rng.randrange(0, 32))), reverse=True)
            for _ in range(rows)]
        gained, deepening = expected_gains(reaches, rates, longest, confidences)
        want, want_deepening = python_gains(reaches, rates, longest, confidences)
        assert gained.tolist() == want.tolist(), trial
        assert deepening.rows() == want_deepening.rows(), trial
        for bar in (0.0, rng.random(), 0.5, 2.0):
            with monkeypatch.context() as patched:
                patched.setattr(gains_module, "kernels", lambda: None)
                looped = cuts(want_deepening, bar)
            assert cuts(deepening, bar) == looped, (trial, bar)
            checked_cuts += 0 < sum(looped) < sum(len(r) for r in reaches)
    assert gains_module.kernels() is not None  # the compiled path ran
    assert checked_cuts > 100  # bars that cut some rows and not others


def test_the_compiled_best_width_equals_the_numpy_plan_bit_for_bit(monkeypatch):
    """SpeculationBudget._best_width, compiled and in numpy arrays, on random rows, costs, penalties and both kinds
    of forward (padded, ragged): the same plan and the same value, or the same refusal against the best so far."""
    from specdec_core.loop.speculation_budget import SpeculationBudget, batch_bucket

    rng = random.Random(11)
    compared = won = 0
    for trial in range(400):
        rows = rng.randrange(1, 70)
        reaches = [random_reach(rng) for _ in range(rows)]
        longest = max(1, min(max(len(r) for r in reaches), rng.choice([4, 8, 16, 64])))
        gained, _ = expected_gains(reaches, [rng.random() for _ in range(rows)], longest)
        budget = SpeculationBudget(ragged=rng.random() < 0.5, gather_share=rng.choice([0.3, 0.5, 0.9]),
                                   check_payoff=rng.random() < 0.7)
        budget.payoff.penalty[batch_bucket(rows)] = rng.choice([1.0, 1.25, 3.0])
        slopes = (rng.random() * 2, rng.random() * 0.2)
        monkeypatch.setattr(budget.cost, "slopes", lambda rows, context=0, _s=slopes: _s)
        caps = [rng.randrange(0, len(r) + 1) for r in reaches]
        best, best_value = [0] * rows, rng.choice([0.0, float(rows), rows * 1.3])
        got = budget._best_width(caps, gained, rows, 0, longest, best, best_value)
        with monkeypatch.context() as patched:
            patched.setattr(gains_module, "kernels", lambda: None)
            want = budget._best_width(caps, gained, rows, 0, longest, best, best_value)
        assert got == want, trial
        compared += 1
        won += got[0] is not best
    assert gains_module.kernels() is not None
    assert 50 < won < compared  # plans that beat the best so far, and some that did not
