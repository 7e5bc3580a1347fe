"""CopySpec index on short token lists: overlap rule, first-match choice, collisions, incremental == rebuild."""

import random

import pytest

from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.drafters.copyspec_index import CopyIndex


def brute_force_source(tokens, gamma):
    """Reference: position after the first occurrence of the last γ tokens, if it does not overlap the suffix."""
    t = len(tokens)
    if t < gamma:
        return None
    suffix = tokens[t - gamma :]
    for p in range(t - gamma + 1):
        if tokens[p : p + gamma] == suffix:
            return p + gamma if p + gamma - 1 < t - gamma else None
    return None


def index_of(tokens, gamma=3, **kwargs):
    index = CopyIndex(gamma, **kwargs)
    index.extend(tokens)
    return index


def test_copies_what_followed_the_first_occurrence():
    tokens = [1, 2, 3, 9, 7, 1, 2, 3, 8, 5, 1, 2, 3]
    index = index_of(tokens)
    assert index.find_copy_source() == 3
    assert index.copy_candidate(4) == [9, 7, 1, 2]


def test_copy_is_cut_at_the_end_of_history():
    index = index_of([4, 5, 6, 7, 4, 5, 6])
    assert index.copy_candidate(10) == [7, 4, 5, 6]


def test_overlapping_first_occurrence_is_not_used():
    # (5,5,5) first occurs at 0, which overlaps the suffix starting at 1.
    assert index_of([5, 5, 5, 5]).find_copy_source() is None
    # (1,2,1) at 0 ends at 2, where the suffix (1,2,1) starts: overlap.
    assert index_of([1, 2, 1, 2, 1]).find_copy_source() is None
    # Just far enough: (1,2,1) at 0 ends at 2 < suffix start 3.
    assert index_of([1, 2, 1, 9, 1, 2, 1]).find_copy_source() == 3


def test_no_match_and_short_history():
    assert index_of([1, 2, 3, 4, 5, 6]).find_copy_source() is None
    assert index_of([1, 2]).find_copy_source() is None
    assert index_of([1, 2, 3, 1, 2, 3]).copy_candidate(0) == []


def test_collisions_are_confirmed_by_comparison():
    # modulus 2: nearly every window collides, so the answer rests on the token comparison.
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        index = index_of(tokens, gamma=3, modulus=2)
        assert index.find_copy_source() == brute_force_source(tokens, 3), tokens


def test_hash_collision_does_not_return_a_different_window():
    index = index_of([1, 2, 3, 4, 5, 6, 7], gamma=2, modulus=1)  # every window hashes to 0
    assert index.find_copy_source() is None
    assert index.first_occurrence() == 5  # the suffix (6, 7) itself, not (1, 2)


@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
def test_matches_brute_force_after_every_token(gamma):
    rng = random.Random(gamma)
    tokens = [rng.randrange(6) for _ in range(400)]
    index = CopyIndex(gamma)
    for i, token in enumerate(tokens):
        index.append(token)
        assert index.find_copy_source() == brute_force_source(tokens[: i + 1], gamma)


def test_incremental_updates_equal_a_rebuild():
    rng = random.Random(1)
    tokens = [rng.randrange(10) for _ in range(500)]
    incremental = CopyIndex(3, modulus=97)  # small modulus: the collision lists take part too
    pos = 0
    while pos < len(tokens):
        step = rng.randrange(1, 12)
        incremental.extend(tokens[pos : pos + step])
        incremental.find_copy_source()  # lookups between updates must not disturb the index
        pos += step
    assert incremental.snapshot() == index_of(tokens, 3, modulus=97).snapshot()


def test_drafter_syncs_only_new_tokens_and_matches_fresh_drafter():
    rng = random.Random(2)
    tokens = [rng.randrange(5) for _ in range(50)]
    drafter = CopySpecDrafter(gamma=3, copy_tokens=6)
    drafter.start(tokens[:10], request=None)
    for end in range(11, 51, 7):
        draft = drafter.propose(tokens[:end], max_tokens=6)
        fresh = CopySpecDrafter(gamma=3, copy_tokens=6)
        fresh.start(tokens[:end], request=None)
        assert draft.tokens == fresh.propose(tokens[:end], max_tokens=6).tokens
        assert len(drafter.index) == end


def test_drafter_respects_max_tokens_and_labels_source():
    drafter = CopySpecDrafter(gamma=2, copy_tokens=10)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    drafter.start(tokens, request=None)
    draft = drafter.propose(tokens, max_tokens=3)
    assert draft.tokens == [3, 4, 5]
    assert draft.source == "copy" and draft.from_context
    assert drafter.propose(tokens, max_tokens=0).tokens == []
