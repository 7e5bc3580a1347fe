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
