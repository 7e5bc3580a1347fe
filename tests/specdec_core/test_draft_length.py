from specdec_core.drafters.draft_length import DraftLength


def test_fixed_length_never_changes():
    length = DraftLength(10)
    length.update(10, 10)
    length.update(10, 0)
    assert length.current == 10


def test_adaptive_grows_on_full_acceptance_and_shrinks_on_rejection():
    length = DraftLength(8, adaptive=True, minimum=2, maximum=40)
    length.update(8, 8)
    assert length.current == 16
    length.update(16, 16)
    length.update(32, 32)
    assert length.current == 40  # capped
    length.update(40, 3)
    assert length.current == 20
    for _ in range(10):
        length.update(length.current, 0)
    assert length.current == 2  # floored


def test_step_growth_adds_two_and_takes_one_away():
    length = DraftLength(4, adaptive=True, minimum=1, maximum=9, growth="step")
    length.update(4, 4)
    assert length.current == 6
    length.update(6, 6)
    length.update(8, 8)
    assert length.current == 9  # capped
    length.update(9, 2)
    assert length.current == 8
    for _ in range(20):
        length.update(length.current, 0)
    assert length.current == 1  # floored


def test_a_draft_cut_by_the_budget_teaches_nothing_about_longer_drafts():
    for growth in ("double", "step"):
        length = DraftLength(8, adaptive=True, minimum=1, maximum=32, growth=growth)
        length.update(3, 3, proposed=8)  # the budget verified 3 of 8 and all 3 were kept
        assert length.current == 8
        length.update(3, 1, proposed=8)  # a rejection inside the verified part still shrinks it
        assert length.current < 8
        before = length.current
        length.update(before, before, proposed=before)  # uncut and fully accepted: grows
        assert length.current > before
