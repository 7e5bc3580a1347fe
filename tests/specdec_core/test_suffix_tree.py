"""The suffix tree's counts and its best-first draft trees, on hand-made sequences (issue 30's core)."""

import pytest

from specdec_core.drafters.suffix_tree import SuffixTree, index_sequences


class Path:
    """A node of `tree` by its token path: .count and .children as the tree holds them."""

    def __init__(self, tree: SuffixTree, tokens):
        self.tree, self.node = tree, tree.node(tokens)
        assert self.node is not None, f"the tree does not hold {tokens}"

    @property
    def count(self) -> int:
        return self.tree.count(self.node)

    @property
    def children(self) -> dict:
        return self.tree.children(self.node)


def path(tree: SuffixTree, tokens) -> Path:
    return Path(tree, tokens)


def lengths(cursor) -> list[int]:
    return [length for _, length in cursor.matched]


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
    assert lengths(cursor) == [3, 2, 1]  # 5 6 7, 6 7, 7 (1 is nowhere)
    tree.advance(cursor, 8)
    assert lengths(cursor) == [4, 3, 2, 1] and cursor.matched[0][0] == path(tree, [5, 6, 7, 8]).node
    tree.advance(cursor, 9)
    assert lengths(cursor) == [1]  # ... 7 8 9: only 9 alone occurs (6 7 9 does, 8 9 does not)
    assert tree.tokens == 7  # matching added nothing


def test_the_draft_tree_is_grown_by_path_probability_and_cut_below_min_prob():
    # After 1 2: 3 followed 6 times (then 4 five times, 5 once), 7 followed 3 times, 8 once.
    tree = index_sequences([[1, 2, 3, 4]] * 5 + [[1, 2, 3, 5]] + [[1, 2, 7]] * 3 + [[1, 2, 8]])
    tokens, parents, score = tree.best_first_tree(path(tree, [1, 2]).node, max_nodes=10, min_prob=0.05)
    # p(3) = 0.6, p(3 4) = 0.5, p(7) = 0.3, p(8) = 0.1, p(3 5) = 0.6 x 1/6 (a hair under 0.1 in floats)
    assert tokens == [3, 4, 7, 8, 5] and parents == [-1, 0, -1, -1, 0]
    assert score == pytest.approx(0.6 + 0.5 + 0.3 + 0.1 + 0.1)  # the expected accepted tokens
    tokens, parents, _ = tree.best_first_tree(path(tree, [1, 2]).node, max_nodes=10, min_prob=0.2)
    assert tokens == [3, 4, 7] and parents == [-1, 0, -1]
    assert tree.best_first_tree(path(tree, [1, 2]).node, max_nodes=2, min_prob=0.0)[:2] == ([3, 4], [-1, 0])


def test_the_draft_starts_at_the_longest_suffix_with_a_continuation_and_scales_with_it():
    tree = SuffixTree(depth=8)
    row = tree.cursor()
    tree.extend(row, [9, 1, 2, 3, 4, 5, 0, 2, 3])  # 2 3 occurred before, followed by 4 5
    draft = tree.draft(row, max_tokens=16, factor=1.0)
    assert draft.match_length == 2 and draft.tokens == [4, 5] and draft.parents == [-1, 0]
    assert tree.draft(row, max_tokens=16, factor=0.5).tokens == [4]  # at most factor x match length nodes
    draft = tree.draft(tree.cursor([7, 7]), max_tokens=16)
    assert (draft.tokens, draft.match_length, draft.score) == ([], 0, 0.0)


def test_a_shorter_match_wins_when_its_tree_is_expected_to_give_more():
    # After 5 6 the trie (depth 3) holds one more token; after 6 alone it holds two: 7 8 (twice) beats 7 (once).
    tree = index_sequences([[5, 6, 7], [6, 7, 8], [6, 7, 8]], depth=3)
    draft = tree.draft(tree.cursor([5, 6]), max_tokens=8, factor=2.0)
    assert (draft.tokens, draft.match_length) == ([7, 8], 1) and draft.score == pytest.approx(2.0)
    assert tree.draft(tree.cursor([5, 6]), max_tokens=8, factor=1.0).match_length == 2  # one node each: a tie


def counts(tree: SuffixTree, node: int = 0, prefix=()) -> dict:
    """Every path the tree holds -> its count."""
    out = {prefix: tree.count(node)} if prefix else {}
    for token, child in tree.children(node).items():
        out.update(counts(tree, child, prefix + (token,)))
    return out


def test_removing_a_sequence_takes_back_exactly_its_counts_and_frees_its_nodes():
    kept, evicted = [1, 2, 3, 1, 2], [2, 3, 4, 2, 3]
    tree = index_sequences([kept, evicted], depth=3)
    tree.remove(evicted)
    alone = index_sequences([kept], depth=3)
    assert counts(tree) == counts(alone) and tree.tokens == len(kept)
    assert 4 not in tree.children(0)  # a node at 0 is gone
    assert tree.node_count == alone.node_count
    tree.extend(tree.cursor(), evicted)  # freed nodes are reused, and the hash table still finds every path
    assert counts(tree) == counts(index_sequences([kept, evicted], depth=3))


def test_a_tree_grows_past_its_first_capacity_and_matches_a_reference_count():
    import random

    generator = random.Random(0)
    sequences = [[generator.randrange(50) for _ in range(generator.randrange(1, 120))] for _ in range(40)]
    tree = SuffixTree(depth=6, capacity=16)
    for sequence in sequences:
        tree.extend(tree.cursor(), sequence)
    expected: dict = {}
    for sequence in sequences:  # every substring of up to 6 tokens, counted by hand
        for start in range(len(sequence)):
            for end in range(start + 1, min(start + 6, len(sequence)) + 1):
                key = tuple(sequence[start:end])
                expected[key] = expected.get(key, 0) + 1
    assert counts(tree) == expected
    for sequence in sequences[::2]:
        tree.remove(sequence)
    assert counts(tree) == counts(index_sequences(sequences[1::2], depth=6))


@pytest.mark.parametrize("depth", [0, -1])
def test_a_tree_needs_a_positive_depth(depth):
    with pytest.raises(ValueError, match="depth"):
        SuffixTree(depth)


def test_a_draft_carries_each_nodes_path_probability():
    """What the budget prices a suffix draft by (Draft.confidence): best first, so never rising, summing to the
    score; the drafter hands them on with its tree."""
    from specdec_core.drafters.base import RequestContext
    from specdec_core.drafters.suffix import SuffixDrafter

    tree = index_sequences([[1, 2, 3, 4]] * 5 + [[1, 2, 3, 5]] + [[1, 2, 7]] * 3 + [[1, 2, 8]])
    draft = tree.draft(tree.cursor([1, 2]), max_tokens=10, factor=4.0, min_prob=0.05)
    assert draft.tokens == [3, 4, 7, 8, 5]
    assert draft.probs == pytest.approx([0.6, 0.5, 0.3, 0.1, 0.1])
    assert sum(draft.probs) == pytest.approx(draft.score)
    drafter = SuffixDrafter(factor=4.0, min_prob=0.05)
    drafter.start([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], RequestContext(prompt_len=10))
    proposed = drafter.propose([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 8)
    assert proposed.tokens[:2] == [3, 4] and proposed.confidence[:2] == [1.0, 1.0]
    assert proposed.truncated(1).confidence == [1.0]


def test_a_rows_own_tree_is_sized_at_start_and_never_grows_while_it_decodes():
    """A row's tree sized for its prompt and the tokens it may still add (RequestContext.tokens_left) holds them all
    without growing its tables (a growth copies them, a few times a row), and drafts exactly what a tree
    that grew from the default size drafts."""
    import random

    from specdec_core.drafters.base import RequestContext
    from specdec_core.drafters.suffix import SuffixDrafter

    generator = random.Random(3)
    prompt = [generator.randrange(30) for _ in range(300)]
    output = [generator.randrange(30) for _ in range(120)]
    sized, grown = SuffixDrafter(), SuffixDrafter()
    sized.start(prompt, RequestContext(prompt_len=len(prompt), tokens_left=len(output)))
    grown.start(prompt, RequestContext(prompt_len=len(prompt)))
    tables = (sized.own.nodes, sized.own.keys)
    tokens, step = list(prompt), 0
    while len(tokens) < len(prompt) + len(output):
        step = step % 3 + 1  # 1, 2 or 3 tokens committed a step
        tokens += output[len(tokens) - len(prompt):][:step]
        got, want = sized.propose(tokens, 8), grown.propose(tokens, 8)
        assert (got.tokens, got.parents, got.confidence) == (want.tokens, want.parents, want.confidence)
    assert sized.own.nodes is tables[0] and sized.own.keys is tables[1]
    assert grown.own.nodes.shape[0] > 1024  # (the default size did grow: the sized tree was put to the test)
    assert sized.own.node_count == grown.own.node_count


def test_a_tree_for_a_sequence_has_room_for_every_node_it_can_make():
    tree = SuffixTree.for_tokens(50, depth=4)
    sequence = list(range(50))  # no repeats: every suffix is new, the most nodes a sequence makes
    nodes, keys = tree.nodes, tree.keys
    tree.extend(tree.cursor(), sequence)
    assert tree.nodes is nodes and tree.keys is keys
    assert tree.node_count == sum(min(4, 50 - start) for start in range(50))


def test_a_row_that_may_write_thousands_of_tokens_starts_with_room_for_a_few_hundred():
    from specdec_core.drafters.base import RequestContext
    from specdec_core.drafters.suffix import SIZED_OUTPUT_TOKENS, SuffixDrafter

    drafter = SuffixDrafter()
    drafter.start([1, 2, 3], RequestContext(prompt_len=3, tokens_left=100_000))
    assert len(drafter.own.nodes) == 1 + (3 + SIZED_OUTPUT_TOKENS) * drafter.depth


def test_a_draft_is_the_best_tree_over_every_held_suffix():
    """The search visits the held suffixes by what they can score and stops early; what it drafts must be what trying
    every held suffix gives: the highest score, the longest suffix among equal scores."""
    import math
    import random

    rng = random.Random(13)
    compared = 0
    for trial in range(60):
        depth = rng.choice([4, 8, 24])
        tree = SuffixTree(depth)
        alphabet = rng.choice([2, 3, 5, 20])
        base = [rng.randrange(alphabet) for _ in range(rng.randrange(20, 60))]
        for _ in range(rng.randrange(1, 5)):  # sequences that repeat each other's stretches: long and short matches
            start = rng.randrange(len(base))
            tree.extend(tree.cursor(), base[start:] + [rng.randrange(alphabet) for _ in range(rng.randrange(30))])
        for _ in range(15):
            cursor = tree.cursor([rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))])
            max_tokens, factor = rng.choice([1, 4, 16, 64]), rng.choice([0.5, 1.0, 2.0])
            min_prob = rng.choice([0.0, 0.1, 0.3])
            best = ([], [], 0, 0.0)
            for node, length in cursor.matched:  # longest first; a tie keeps the longer
                budget = min(max_tokens, math.floor(factor * length))
                if budget <= 0:
                    continue
                tokens, parents, score = tree.best_first_tree(node, budget, min_prob)
                if score > best[3]:
                    best = (tokens, parents, length, score)
            got = tree.draft(cursor, max_tokens, factor, min_prob)
            assert (got.tokens, got.parents, got.match_length, got.score) == best, trial
            compared += bool(best[0])
    assert compared > 300


def test_a_draft_past_the_cursor_equals_the_draft_from_the_cursor_advanced():
    """`pending` tokens are looked up only from the suffixes the search reaches: the draft must be the one from the
    cursor advanced by them, on trees that changed since the cursor matched (sequences added and removed), where a
    suffix reaches the depth, and from an empty cursor; and the pair of trees' draft the better of the two."""
    import random

    from specdec_core.drafters.suffix_tree import Cursor

    def advanced(tree, cursor, tokens):
        copy = Cursor(tree.depth)
        copy.nodes[:], copy.lengths[:], copy.size[:] = cursor.nodes, cursor.lengths, cursor.size
        tree.advance(copy, tokens)
        return copy

    rng = random.Random(29)
    compared = won = 0
    for trial in range(80):
        depth = rng.choice([3, 6, 24])
        alphabet = rng.choice([2, 3, 6, 30])
        base = [rng.randrange(alphabet) for _ in range(80)]
        trees, sequences = [SuffixTree(depth), SuffixTree(depth)], []
        for tree in trees:
            for _ in range(rng.randrange(1, 4)):
                start = rng.randrange(len(base))
                sequences.append((tree, base[start: start + rng.randrange(5, 50)]))
                tree.extend(tree.cursor(), sequences[-1][1])
        for _ in range(12):
            start = rng.randrange(len(base))
            seen = base[start: start + rng.randrange(0, 30)]
            cursors = [tree.cursor(seen) for tree in trees]
            if rng.random() < 0.4:  # the trees change after the cursors matched
                tree, removed = sequences.pop(rng.randrange(len(sequences))) if len(sequences) > 2 else (None, None)
                if tree is not None:
                    tree.remove(removed)
                added = trees[rng.randrange(2)]
                sequences.append((added, base[rng.randrange(len(base)):]))
                added.extend(added.cursor(), sequences[-1][1])
            step = start + len(seen)
            pending = (base[step: step + rng.randrange(0, 6)] if rng.random() < 0.7
                       else [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))])
            limits = (rng.choice([0, 1, 4, 16, 64]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.3]))
            drafts = []
            for tree, cursor in zip(trees, cursors):
                expected = tree.draft(advanced(tree, cursor, pending), *limits)
                got = tree.draft(cursor, *limits, pending=pending)
                assert (got.tokens, got.parents, got.match_length, got.score, got.probs) == (
                    expected.tokens, expected.parents, expected.match_length, expected.score, expected.probs), trial
                drafts.append(expected)
                compared += bool(expected.tokens)
            pair, other_won = trees[0].best_draft(cursors[0], pending, limits, trees[1], cursors[1])
            better = drafts[1] if drafts[1].score > drafts[0].score else drafts[0]
            assert (pair.tokens, pair.parents, pair.match_length, pair.score, other_won) == (
                better.tokens, better.parents, better.match_length, better.score, better is drafts[1]), trial
            won += other_won
    assert compared > 800 and won > 100
