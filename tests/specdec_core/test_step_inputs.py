"""A step's input tensors (step_inputs.py): a worked example of a chain, a tree and a plain row, and the compiled
pass equal to the numpy build on random batches."""

import random

import pytest
import torch

from specdec_core.drafters.base import Draft, empty_draft
from specdec_core.loop import step_inputs as inputs_module
from specdec_core.loop.step_inputs import python_step_inputs, step_inputs


@pytest.mark.parametrize("compiled", [True, False])
def test_a_chain_a_tree_and_a_plain_row(compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(inputs_module, "inputs_kernel", lambda: None)
    # row 0: a chain of 2; row 1: the tree of draft_tree.py's example; row 2: no draft
    drafts = [Draft([7, 8], "s"), Draft([5, 6, 7, 8], "s", parents=[-1, 0, 1, 0]), empty_draft()]
    ids, positions, visible, logit_index = step_inputs([10, 20, 30], [1, 2, 3], drafts, 5)
    assert ids.tolist() == [[1, 7, 8, 0, 0], [2, 5, 6, 7, 8], [3, 0, 0, 0, 0]]
    assert positions.tolist() == [[10, 11, 12, 13, 14], [20, 21, 22, 23, 22], [30, 31, 32, 33, 34]]
    assert visible[0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0] * 5, [0] * 5]
    assert visible[1].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                         [1, 1, 0, 0, 1]]
    assert visible[2].int().tolist() == [[1, 0, 0, 0, 0]] + [[0] * 5] * 4
    assert logit_index.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [1, 3], [1, 4], [2, 0]]


def random_draft(rng, most):
    size = rng.randrange(0, most + 1)
    tokens = [rng.randrange(50000) for _ in range(size)]
    if size > 1 and rng.random() < 0.5:
        return Draft(tokens, "s", parents=[rng.randrange(-1, i) for i in range(size)])
    return Draft(tokens, "s")


def test_the_compiled_pass_equals_the_numpy_build(monkeypatch):
    rng = random.Random(5)
    for trial in range(200):
        rows = rng.randrange(1, 70)
        width = rng.choice([1, 2, 5, 17])
        drafts = [random_draft(rng, width - 1) for _ in range(rows)]
        lengths = [rng.randrange(1, 4000) for _ in range(rows)]
        pending = [rng.randrange(50000) for _ in range(rows)]
        width = max(width, 1 + max(len(d) for d in drafts))
        got = step_inputs(lengths, pending, drafts, width)
        want = python_step_inputs(lengths, pending, drafts, width)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), trial
    assert inputs_module.inputs_kernel() is not None  # the compiled pass ran


def test_chain_visibility_is_each_rows_lower_triangle_within_its_nodes(monkeypatch):
    """Rows copy a cached triangle (grown as wider chunks come, built per call past CACHED_WIDTH) and clear their
    padding: what the definition gives, for narrower widths after wider ones too, and writable per call."""
    import numpy as np

    from specdec_core.loop import step_inputs

    monkeypatch.setattr(step_inputs, "CACHED_WIDTH", 12)
    monkeypatch.setattr(step_inputs, "_LOWER", np.ones((0, 0), dtype=bool))
    rng = np.random.default_rng(5)
    for width in [3, 9, 1, 16, 5, 12, 20, 7]:
        counts = rng.integers(0, width + 1, size=rng.integers(1, 5))
        inside, visible = step_inputs.chain_visibility(counts, width)
        t = np.arange(width)
        expected_inside = t[None, :] < counts[:, None]
        expected = (t[:, None] >= t[None, :])[None] & expected_inside[:, :, None] & expected_inside[:, None, :]
        assert (inside == expected_inside).all() and (visible == expected).all() and visible.shape == expected.shape
        visible[:] = False  # the caller's to write: the cached triangle stays as it was
    assert len(step_inputs._LOWER) == 12 and (step_inputs._LOWER == np.tri(12, dtype=bool)).all()
