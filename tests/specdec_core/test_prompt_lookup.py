"""Prompt lookup's pure search on tiny arrays (vLLM test_ngram style)."""

import numpy as np

from specdec_core.drafters.prompt_lookup import PromptLookupDrafter, find_prompt_lookup_draft


def find(tokens, max_ngram=3, min_ngram=1, k=4):
    return find_prompt_lookup_draft(np.array(tokens, dtype=np.int64), max_ngram, min_ngram, k)


def test_longest_ngram_wins():
    # suffix 3-gram (1,2,3) occurs at 4; the 1-gram (3) occurs earlier at 0.
    assert find([3, 9, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1, 2]


def test_falls_back_to_shorter_ngram_and_first_occurrence():
    assert find([5, 6, 1, 5, 7, 5]) == [6, 1, 5, 7]


def test_no_match_gives_empty_draft():
    assert find([1, 2, 3, 4]) == []
    assert find([7]) == []
    assert find([1, 2, 1, 2], k=0) == []


def test_draft_is_cut_at_history_end():
    assert find([1, 2, 3, 1, 2], k=10) == [3, 1, 2]


def test_min_ngram_is_respected():
    assert find([5, 6, 1, 5], min_ngram=2) == []


def test_drafter_keeps_a_growing_buffer():
    drafter = PromptLookupDrafter(num_tokens=3)
    tokens = [1, 2, 3, 4, 1, 2]
    assert drafter.propose(tokens, 10).tokens == [3, 4, 1]
    tokens += [3, 9, 9]
    # (3,9,9) and (9,9) never occurred before; the 1-gram (9) at index 7 is followed by 9.
    assert drafter.propose(tokens, 2).tokens == [9]


def test_the_compiled_scan_finds_the_same_occurrences_as_numpy_windows(monkeypatch):
    from numpy.lib.stride_tricks import sliding_window_view

    from specdec_core.drafters import prompt_lookup

    assert prompt_lookup.hit_kernel() is not None, prompt_lookup.hit_kernel.unavailable
    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(300):
        tokens = rng.integers(0, 1 + trial % 6, size=int(rng.integers(1, 60)))  # small alphabets: many repeats
        for n in range(1, min(4, len(tokens) - 1) + 1):
            windows = sliding_window_view(tokens[:-1], n)
            want = np.flatnonzero((windows == tokens[len(tokens) - n:]).all(axis=1))
            got = prompt_lookup.suffix_hits(tokens, n)
            assert got.tolist() == want.tolist()
            checked += len(want)
    assert checked > 1000
    monkeypatch.setattr(prompt_lookup.hit_kernel, "_kernel", None)
    monkeypatch.setattr(prompt_lookup.hit_kernel, "unavailable", "no numba here")
    assert find([3, 9, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1, 2]  # the numpy fallback


def test_the_one_call_match_drafts_what_the_per_length_search_drafts(monkeypatch):
    """find_prompt_lookup_draft scans every n-gram length in one compiled call; the per-length search it replaces
    (find_prompt_lookup_candidates, also the numpy fallback) must give the same draft, and so must the drafter."""
    from specdec_core.drafters import prompt_lookup
    from specdec_core.drafters.prompt_lookup import find_prompt_lookup_candidates

    assert prompt_lookup.match_kernel() is not None, prompt_lookup.match_kernel.unavailable
    rng = np.random.default_rng(1)
    found = 0
    for trial in range(400):
        tokens = rng.integers(0, 2 + trial % 7, size=int(rng.integers(0, 50)))
        max_n = int(rng.integers(1, 5))
        min_n = int(rng.integers(1, max_n + 1))
        k = int(rng.integers(0, 6))
        want = find_prompt_lookup_candidates(tokens, max_n, min_n, k, count=1)
        want = want[0] if want else []
        assert find_prompt_lookup_draft(tokens, max_n, min_n, k) == want, (tokens.tolist(), max_n, min_n, k)
        drafter = PromptLookupDrafter(num_tokens=max(k, 1), max_ngram=max_n, min_ngram=min_n)
        if k:
            assert drafter.propose(tokens.tolist(), k).tokens == want
        found += bool(want)
    assert found > 150
    monkeypatch.setattr(prompt_lookup.match_kernel, "_kernel", None)
    monkeypatch.setattr(prompt_lookup.match_kernel, "unavailable", "no numba here")
    assert find([3, 9, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1, 2]  # the per-length fallback
