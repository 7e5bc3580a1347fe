"""Perplexity scoring (corpus refinement): windows, packing, exactness against a plain forward, selection."""

import math

import numpy as np
import pytest
import torch

from operators.perplexity import PerplexityScorer, pack_windows, text_windows
from pipelines.refine import select_kept


@pytest.mark.parametrize("n, window, overlap", [(1, 8, 2), (2, 8, 2), (8, 8, 2), (9, 8, 2), (50, 8, 0), (50, 8, 6),
                                                (1000, 64, 16)])
def test_windows_score_every_token_but_the_first_once_with_context(n, window, overlap):
    windows = text_windows(3, n, window, overlap)
    scored = [i for w in windows for i in range(w.first_scored, w.end)]
    assert scored == list(range(1, n))
    for w in windows:
        assert w.length <= window and w.begin < w.first_scored <= w.end
        if w.begin > 0:  # a later window: at least `overlap` tokens of context before its first scored token
            assert w.first_scored - 1 - w.begin >= overlap


def test_bad_window_settings_are_refused():
    with pytest.raises(ValueError):
        text_windows(0, 10, 8, 7)  # no new token per window: would never end


def test_packing_keeps_forwards_within_the_token_budget_and_every_window_once():
    windows = [w for i, n in enumerate([5, 300, 40, 41, 2, 900, 17]) for w in text_windows(i, n, 256, 32)]
    batches = pack_windows(windows, 512)
    assert sorted((w.text, w.begin) for b in batches for w in b) == sorted((w.text, w.begin) for w in windows)
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(w.length for w in batch) <= 512


def reference_ppl(model, ids):
    """exp(mean NLL of tokens 1..n-1) from one plain Hugging Face forward of the whole text."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()  # [n, V]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


@pytest.mark.slow
def test_perplexity_equals_exp_mean_nll_of_a_plain_forward_in_a_padded_batch(engine):
    runner = engine.target
    texts = ["def add(a, b):\n    return a + b\n", "The cat sat on the mat. The cat sat on the mat again.",
             "Speculative decoding drafts tokens cheaply and verifies them with the target model in one forward."]
    ids = [runner.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    scores = PerplexityScorer(runner, window=256, overlap=32, tokens_per_forward=4096).score(ids)  # one forward
    for token_ids, score in zip(ids, scores):
        assert score.token_count == len(token_ids) and score.scored_tokens == len(token_ids) - 1
        assert score.ppl == pytest.approx(reference_ppl(runner.model, token_ids), rel=1e-4)
    # A text longer than the window: each window's NLL is its own plain forward's (windows of 24, 8 context).
    long_ids = ids[2] * 3
    windowed = PerplexityScorer(runner, window=24, overlap=8, tokens_per_forward=64).score([long_ids, ids[0]])[0]
    expected = 0.0
    for w in text_windows(0, len(long_ids), 24, 8):
        with torch.inference_mode():
            logits = runner.model(torch.tensor([long_ids[w.begin:w.end]])).logits[0].float()
        rows = torch.arange(w.first_scored - w.begin - 1, w.length - 1)
        expected += torch.nn.functional.cross_entropy(logits[rows], torch.tensor(long_ids[w.first_scored:w.end]),
                                                      reduction="sum").item()
    assert windowed.scored_tokens == len(long_ids) - 1
    assert windowed.nll_sum == pytest.approx(expected, rel=1e-4)


def test_selection_keeps_exactly_the_n_lowest_and_never_an_error_row():
    ppl = np.array([5.0, np.nan, 1.5, 9.0, 1.5, 3.0, np.nan, 2.0])
    keys = [f"t{i}" for i in range(len(ppl))]
    kept = select_kept(ppl, keys, keep=3, keep_fraction=None)
    assert kept.tolist() == [False, False, True, False, True, False, False, True]  # 1.5, 1.5, 2.0
    assert select_kept(ppl, keys, keep=100, keep_fraction=None).sum() == 6  # every scored text, no error row
    fraction = select_kept(ppl, keys, keep=None, keep_fraction=0.5)  # half of the 6 scored
    assert fraction.sum() == 3 and (fraction == kept).all()
    random = select_kept(ppl, keys, keep=3, keep_fraction=None, selection="random", seed=1)
    assert random.sum() == 3 and not random[np.isnan(ppl)].any()
    assert (random == select_kept(ppl, keys, keep=3, keep_fraction=None, selection="random", seed=1)).all()


def test_a_token_budget_keeps_the_lowest_texts_that_fit_in_order():
    ppl = np.array([5.0, np.nan, 1.5, 9.0, 1.0, 3.0, np.nan, 2.0])
    counts = np.array([10, 0, 40, 10, 30, 10, 0, 20], dtype=np.float64)
    keys = [f"t{i}" for i in range(len(ppl))]

    def budget(tokens, **kw):
        return select_kept(ppl, keys, None, None, keep_tokens=tokens, token_counts=counts, **kw)

    # lowest first: 1.0 (30), 1.5 (40) -> 70 tokens; the next, 2.0 (20), would pass 80: the selection ends there
    assert np.flatnonzero(budget(80)).tolist() == [2, 4]
    assert np.flatnonzero(budget(90)).tolist() == [2, 4, 7]
    assert not budget(29).any()
    assert budget(10_000).sum() == 6  # every scored text, never an error row
    for seed in range(5):
        random = budget(60, selection="random", seed=seed)
        assert counts[random].sum() <= 60 and not random[np.isnan(ppl)].any()
