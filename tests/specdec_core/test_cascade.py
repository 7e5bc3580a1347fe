"""The `auto` cascade (drafters/cascade.py): which candidate proposes, and how each candidate's expectation learns,
on hand-made drafters and token streams (no model)."""

from specdec_core.drafters.base import Draft, Drafter, RequestContext
from specdec_core.drafters.cascade import SMOOTHING, CascadeDrafter
from specdec_core.loop.verification import greedy_accepted as accepted_along


class Fixed(Drafter):
    """Always proposes the same chain."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, tokens, max_tokens):
        return Draft(tokens=self.tokens[:max_tokens], source="copy")


def test_accepted_along_reads_a_chains_prefix_and_a_trees_deepest_matching_path():
    chain = Draft(tokens=[5, 6, 7], source="copy")
    assert accepted_along(chain, [5, 6, 9]) == 2
    assert accepted_along(chain, [4]) == 0
    assert accepted_along(chain, [5, 6]) == 2  # at most what the step committed
    assert accepted_along(chain, [5, 6, 7, 8]) == 3
    # root -> 5 (node 0) -> 6 (node 1) -> 1 (node 3); root -> 5 -> 9 (node 2); root -> 8 (node 4) -> 9 (node 5)
    tree = Draft(tokens=[5, 6, 9, 1, 8, 9], source="copy", parents=[-1, 0, 0, 1, -1, 4])
    assert accepted_along(tree, [5, 9, 3]) == 2
    assert accepted_along(tree, [5, 6, 1, 2]) == 3
    assert accepted_along(tree, [8, 9]) == 2
    assert accepted_along(tree, [6, 1]) == 0  # node 3's token at depth 3 only counts under 5 -> 6


def test_a_candidate_not_chosen_learns_what_its_draft_would_have_had_accepted():
    """Candidate 0 is chosen (its expectation is higher) and has 1 of its 2 tokens accepted each step; candidate 1's
    drafts would have had all 3 accepted. Its stale expectation rises from what each step committed, until the row
    switches to it; the chosen one learns what the target accepted."""
    target = [1, 2, 3] * 20  # the tokens the target emits
    first, second = Fixed([1, 9]), Fixed([1, 2, 3])
    cascade = CascadeDrafter([first, second])
    cascade.start([0], RequestContext(prompt_len=1))
    cascade.expected = [1.5, 0.5]
    tokens, chosen = [0], []
    for _ in range(6):
        draft = cascade.propose(tokens, 8)
        chosen.append(cascade.chosen)
        accepted = accepted_along(draft, target[:len(draft.tokens) + 1])
        before = list(cascade.expected)
        tokens += target[:accepted + 1]
        cascade.observe(tokens, draft, accepted)
        if chosen[-1] == 0:
            assert accepted == 1
            assert cascade.expected[0] == (1 - SMOOTHING) * before[0] + SMOOTHING * 1
            # the step committed 2 tokens, both candidate 1's: it would have had 2 accepted (more is not known)
            assert cascade.expected[1] == (1 - SMOOTHING) * before[1] + SMOOTHING * 2
    assert chosen[:2] == [0, 0] and chosen[-1] == 1, chosen


def test_a_draft_that_proposes_nothing_teaches_nothing():
    cascade = CascadeDrafter([Fixed([]), Fixed([4])])
    cascade.start([0], RequestContext(prompt_len=1))
    draft = cascade.propose([0], 8)
    assert cascade.chosen == 1 and draft.tokens == [4]
    prior = cascade.expected[0]
    cascade.observe([0, 4, 5], draft, 1)
    assert cascade.expected[0] == prior


def test_a_count_the_step_cannot_see_past_only_raises_an_expectation():
    """The chosen draft is rejected at its first token, so the step commits one token; the other candidate's draft
    matches it and goes on: it would have had at least 1 accepted, maybe more, so its expectation of 2 stays. A
    candidate whose draft parts from the committed tokens learns its exact count."""
    cascade = CascadeDrafter([Fixed([7, 7]), Fixed([1, 2, 3]), Fixed([9])])
    cascade.start([0], RequestContext(prompt_len=1))
    cascade.expected = [3.0, 2.0, 2.0]
    draft = cascade.propose([0], 8)
    assert cascade.chosen == 0
    cascade.observe([0, 1], draft, 0)
    assert cascade.expected == [(1 - SMOOTHING) * 3.0, 2.0, (1 - SMOOTHING) * 2.0]
