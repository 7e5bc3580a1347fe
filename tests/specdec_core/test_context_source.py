"""The request's `context` as a draft source: the once-per-request index and the copy drafters that read it."""

import numpy as np
import pytest

from specdec_core.drafters.base import CONTEXT_SOURCE, RequestContext
from specdec_core.drafters.context_index import ContextIndex
from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.drafters.prompt_lookup import PromptLookupDrafter


def brute_force(document, suffix, num_tokens, count):
    out = []
    n = len(suffix)
    for start in range(len(document) - n):
        if document[start : start + n] == suffix:
            continuation = document[start + n : start + n + num_tokens]
            if continuation not in out:
                out.append(continuation)
            if len(out) == count:
                break
    return out


def test_context_index_finds_first_occurrences_in_order():
    index = ContextIndex([1, 2, 3, 9, 1, 2, 4, 1, 2, 3, 5, 1, 2])
    assert index.continuations([1, 2], 2, count=1) == [[3, 9]]
    assert index.continuations([1, 2], 2, count=3) == [[3, 9], [4, 1], [3, 5]]
    assert index.continuations([1, 2], 1, count=3) == [[3], [4]]  # distinct continuations only
    # The last window (1, 2) at the document's end has nothing after it: never a candidate.
    assert index.continuations([3, 5, 1, 2], 4) == []
    assert index.continuations([7], 3) == []
    assert index.continuations([1, 2], 0) == []
    assert index.continuations([], 3) == []
    assert ContextIndex([]).continuations([1], 3) == []


def test_context_index_matches_brute_force_on_a_random_document():
    rng = np.random.default_rng(0)
    document = rng.integers(0, 6, size=3000).tolist()  # small alphabet: many repeats
    index = ContextIndex(document)
    for trial in range(200):
        n = int(rng.integers(1, 5))
        start = int(rng.integers(0, len(document) - n))
        suffix = document[start : start + n] if trial % 3 else rng.integers(0, 7, size=n).tolist()
        assert index.continuations(suffix, 5, count=3, scan=10**6) == brute_force(document, suffix, 5, 3)


def test_context_index_scans_a_bounded_number_of_occurrences():
    index = ContextIndex([0, 1] * 1000 + [0, 2])
    # Only (0 -> 1) among the first 32 occurrences of 0; the (0 -> 2) at the end is past the scan.
    assert index.continuations([0], 1, count=2) == [[1]]
    assert index.continuations([0], 1, count=2, scan=10**4) == [[1], [2]]


def started(drafter, history, context):
    drafter.start(history, RequestContext(prompt_len=len(history), context_ids=context))
    return drafter


def test_pld_copies_from_the_context_when_the_history_has_no_match():
    context = [50, 51, 52, 53, 54, 55, 56]
    drafter = started(PromptLookupDrafter(num_tokens=3), [7, 8, 51, 52], context)
    draft = drafter.propose([7, 8, 51, 52], 10)
    assert draft.tokens == [53, 54, 55] and draft.source == CONTEXT_SOURCE and draft.from_context
    # Without a context the same history drafts nothing.
    plain = started(PromptLookupDrafter(num_tokens=3), [7, 8, 51, 52], None)
    assert plain.propose([7, 8, 51, 52], 10).tokens == []


def test_pld_prefers_the_longest_ngram_across_history_and_context():
    history = [9, 3, 40, 1, 2, 3]  # the 1-gram (3) reappears in the history; the 3-gram (1, 2, 3) only in the context
    drafter = started(PromptLookupDrafter(num_tokens=2), history, [1, 2, 3, 60, 61])
    draft = drafter.propose(history, 10)
    assert draft.tokens == [60, 61] and draft.source == CONTEXT_SOURCE
    # At equal n the history wins (the paper's rule for rows without a context is unchanged).
    history = [1, 2, 3, 70, 1, 2, 3]
    drafter = started(PromptLookupDrafter(num_tokens=2), history, [1, 2, 3, 60, 61])
    assert drafter.propose(history, 10).tokens == [70, 1] and drafter.propose(history, 10).source == "lookup"


def test_copyspec_copies_from_the_context_and_mixes_sources_in_a_tree():
    history = [5, 6, 7, 8, 10, 11, 6, 7, 8]  # suffix (6, 7, 8) occurred at 1 in the history
    context = [6, 7, 8, 20, 21, 6, 7, 8, 10, 11]
    one = started(CopySpecDrafter(gamma=3, copy_tokens=2), history, context)
    chain = one.propose(history, 10)
    assert chain.tokens == [10, 11] and chain.source == "copy"  # history first
    three = started(CopySpecDrafter(gamma=3, copy_tokens=2, candidates=3), history, context)
    tree = three.propose(history, 10)
    # Branches: history (10, 11), then the context's (20, 21); the context's (10, 11) repeats the first branch.
    assert tree.tokens == [10, 11, 20, 21] and tree.parents == [-1, 0, -1, 2]
    assert [tree.source_of(i) for i in range(4)] == ["copy", "copy", CONTEXT_SOURCE, CONTEXT_SOURCE]
    assert tree.truncated(3).token_sources == ["copy", "copy", CONTEXT_SOURCE]
    only_context = started(CopySpecDrafter(gamma=3, copy_tokens=4), [1, 6, 7, 8], context)
    draft = only_context.propose([1, 6, 7, 8], 3)
    assert draft.tokens == [20, 21, 6] and draft.source == CONTEXT_SOURCE


@pytest.mark.parametrize("drafter_type", [PromptLookupDrafter, CopySpecDrafter])
def test_adaptive_length_learns_from_context_drafts(drafter_type):
    drafter = started(drafter_type(adaptive=True), [1, 2, 3], list(range(100, 200)) + [1, 2, 3] + list(range(300, 400)))
    before = drafter.length.current
    draft = drafter.propose([1, 2, 3], 64)
    assert draft.source == CONTEXT_SOURCE
    drafter.observe([1, 2, 3] + draft.tokens + [0], draft, len(draft))  # all accepted: the length grows
    assert drafter.length.current > before
