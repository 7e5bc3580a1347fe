"""Draft-tree index arithmetic (draft_tree.py's worked example) and multi-candidate copy/lookup proposals."""

import random

import numpy as np
import pytest
import torch

from specdec_core.loop import draft_tree
from specdec_core.loop.draft_tree import ancestor_mask, build_trie, children_of, depths, prefix_depths
from specdec_core.drafters.base import Draft
from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.drafters.copyspec_index import CopyIndex
from specdec_core.drafters.prompt_lookup import find_prompt_lookup_candidates


def test_trie_of_the_worked_example():
    tokens, parents = build_trie([[5, 6, 7], [5, 8]])
    assert (tokens, parents) == ([5, 6, 7, 8], [-1, 0, 1, 0])
    assert depths(parents) == [1, 2, 3, 2]
    assert prefix_depths(parents) == [1, 2, 3, 3]
    assert children_of(parents) == {0: [1], 1: [2, 4], 2: [3]}
    visible = ancestor_mask(parents, 6).int().tolist()
    assert visible[3] == [1, 1, 1, 1, 0, 0]  # node 3 (token 7) sees 0, 1, 2, itself
    assert visible[4] == [1, 1, 0, 0, 1, 0]  # node 4 (token 8) sees 0, 1, itself
    assert visible[5] == [0] * 6  # padding sees no new token


def test_a_tree_cut_short_is_still_a_tree_and_a_one_branch_tree_is_a_chain():
    draft = Draft(tokens=[5, 6, 7, 8], source="copy", parents=[-1, 0, 1, 0])
    cut = draft.truncated(2)
    assert cut.tokens == [5, 6] and cut.parents is None  # [-1, 0] is a chain
    assert draft.max_depth == 3 and draft.truncated(4) is draft
    with pytest.raises(ValueError):
        Draft(tokens=[1, 2], source="copy", parents=[-1, 1])  # a parent after its child
    with pytest.raises(ValueError):
        Draft(tokens=[1, 2], source="draft_model", parents=[-1, -1], probs=torch.ones(2, 3))


def test_copy_index_offers_distinct_continuations_first_occurrence_first():
    index = CopyIndex(gamma=2, keep_all=True)
    # "1 2" occurs three times, followed by 3 4, 9 9, 3 4; the history ends with "1 2".
    index.extend([1, 2, 3, 4, 0, 1, 2, 9, 9, 0, 1, 2, 3, 4, 0, 1, 2])
    assert index.copy_candidate(2) == [3, 4]
    assert index.copy_candidates(2, count=3) == [[3, 4], [9, 9]]  # the third repeats the first
    assert index.copy_candidates(2, count=1) == [[3, 4]]
    assert CopyIndex(gamma=2).copy_candidates(2, count=3) == []  # nothing indexed


def test_copyspec_with_candidates_drafts_a_tree():
    drafter = CopySpecDrafter(gamma=2, copy_tokens=2, candidates=3)
    drafter.index = drafter._new_index()
    history = [1, 2, 3, 4, 0, 1, 2, 9, 9, 0, 1, 2]
    draft = drafter.propose(history, max_tokens=10)
    assert draft.tokens == [3, 4, 9, 9] and draft.parents == [-1, 0, -1, 2]
    assert drafter.propose(history, max_tokens=3).tokens == [3, 4, 9]  # cut to the budget, still a tree


def test_prompt_lookup_candidates():
    tokens = np.array([7, 1, 2, 7, 3, 4, 7, 1, 5, 7])
    assert find_prompt_lookup_candidates(tokens, 1, 1, 2, count=3) == [[1, 2], [3, 4], [1, 5]]
    assert find_prompt_lookup_candidates(tokens, 1, 1, 1, count=3) == [[1], [3]]
    assert find_prompt_lookup_candidates(np.array([1, 2, 3]), 2, 1, 2, count=3) == []


@pytest.mark.parametrize("compiled", [True, False])
def test_a_steps_tree_rows_are_written_in_as_each_row_alone(compiled, monkeypatch):
    """trees_into (one compiled call for every tree row of a step, or row by row where numba does not compile)
    writes each tree row's masks and depths as ancestor_array and depths give them alone, and leaves chain rows
    and padding as they were."""
    if not compiled:
        monkeypatch.setattr(draft_tree, "tree_kernel", lambda: None)
    rng = random.Random(5)
    for _ in range(50):
        width, batch = rng.randrange(2, 20), rng.randrange(1, 12)
        trees = {b: [rng.randrange(-1, i) for i in range(rng.randrange(0, width))] for b in range(batch)
                 if rng.random() < 0.6}
        visible = np.tril(np.ones((width, width), dtype=bool))[None].repeat(batch, 0)  # chain rows' masks
        offsets = np.tile(np.arange(width), (batch, 1))
        want_visible, want_offsets = visible.copy(), offsets.copy()
        for b, parents in trees.items():
            want_visible[b] = draft_tree.ancestor_array(parents, width)
            want_offsets[b, 1:len(parents) + 1] = draft_tree.depths(parents)
        draft_tree.trees_into(visible, offsets, list(trees), list(trees.values()))
        assert (visible == want_visible).all() and (offsets == want_offsets).all()
    assert (draft_tree.tree_kernel() is not None) == compiled
