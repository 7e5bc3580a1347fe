"""The suffix tree's counts and its best-first draft trees, on hand-made sequences (issue 30's core)."""

import pytest

from specdec_core.drafters.suffix_tree import Cursor, SuffixTree, best_first_tree, index_sequences


def path(tree: SuffixTree, tokens):
    node = tree.root
    for token in tokens:
        node = node.children[token]
    return node


def test_every_suffix_counts_once_per_occurrence_up_to_the_depth():
    tree = index_sequences([[1, 2, 3, 1, 2, 4]], depth=3)
    assert path(tree, [1, 2]).count == 2 and path(tree, [2]).count == 2
    assert path(tree, [1, 2, 3]).count == 1 and path(tree, [1, 2, 4]).count == 1
    assert set(path(tree, [1, 2]).children) == {3, 4}
    assert not path(tree, [2, 3, 1]).children  # depth 3: no path is longer (2 followed it)
    assert tree.tokens == 6


def test_sequences_are_indexed_apart():
    tree = index_sequences([[1, 2], [3, 4]])
    assert 3 not in path(tree, [2]).children  # no suffix runs from one sequence into the next


def test_the_cursor_keeps_the_longest_held_suffix_first():
    tree = index_sequences([[5, 6, 7, 8], [6, 7, 9]])
    cursor = tree.cursor([1, 5, 6, 7])
    assert cursor.lengths == [3, 2, 1]  # 5 6 7, 6 7, 7 (1 is nowhere)
    tree.advance(cursor, 8)
    assert cursor.lengths == [4, 3, 2, 1] and cursor.nodes[0] is path(tree, [5, 6, 7, 8])
    tree.advance(cursor, 9)
    assert cursor.lengths == [1]  # ... 7 8 9: only 9 alone occurs (6 7 9 does, 8 9 does not)
    assert tree.tokens == 7  # matching added nothing


def test_the_draft_tree_is_grown_by_path_probability_and_cut_below_min_prob():
    # After 1 2: 3 followed 6 times (then 4 five times, 5 once), 7 followed 3 times, 8 once.
    tree = index_sequences([[1, 2, 3, 4]] * 5 + [[1, 2, 3, 5]] + [[1, 2, 7]] * 3 + [[1, 2, 8]])
    tokens, parents = best_first_tree(path(tree, [1, 2]), max_nodes=10, min_prob=0.05)
    # p(3) = 0.6, p(3 4) = 0.5, p(7) = 0.3, p(8) = 0.1, p(3 5) = 0.6 x 1/6 (a hair under 0.1 in floats)
    assert tokens == [3, 4, 7, 8, 5] and parents == [-1, 0, -1, -1, 0]
    tokens, parents = best_first_tree(path(tree, [1, 2]), max_nodes=10, min_prob=0.2)
    assert tokens == [3, 4, 7] and parents == [-1, 0, -1]
    assert best_first_tree(path(tree, [1, 2]), max_nodes=2, min_prob=0.0) == ([3, 4], [-1, 0])


def test_the_draft_starts_at_the_longest_suffix_with_a_continuation_and_scales_with_it():
    tree = SuffixTree(depth=8)
    row = Cursor()
    tree.extend(row, [9, 1, 2, 3, 4, 5, 0, 2, 3])  # 2 3 occurred before, followed by 4 5
    tokens, parents, matched = tree.draft(row, max_tokens=16, factor=1.0)
    assert matched == 2 and tokens == [4, 5] and parents == [-1, 0]
    tokens, _, _ = tree.draft(row, max_tokens=16, factor=0.5)
    assert tokens == [4]  # at most factor x match length nodes
    tokens, _, matched = tree.draft(tree.cursor([7, 7]), max_tokens=16)
    assert (tokens, matched) == ([], 0)


@pytest.mark.parametrize("depth", [0, -1])
def test_a_tree_needs_a_positive_depth(depth):
    with pytest.raises(ValueError, match="depth"):
        SuffixTree(depth)
