"""Quality metrics: worked examples, and ROUGE-L's dynamic programme against a brute-force LCS."""

import itertools
import random

import pytest

from analysis.quality import _lcs_length, exact_match, extract_code, rouge_l, score, token_f1


def brute_force_lcs(a, b):
    for size in range(min(len(a), len(b)), 0, -1):
        subsequences = set(itertools.combinations(b, size))
        if any(c in subsequences for c in itertools.combinations(a, size)):
            return size
    return 0


def test_lcs_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 7))]
        b = [rng.choice("abc") for _ in range(rng.randint(0, 7))]
        assert _lcs_length(a, b) == brute_force_lcs(a, b), (a, b)


def test_rouge_l_worked_examples():
    # LCS "the cat on the mat" = 5 of 6 tokens each way: P = R = F = 5/6.
    assert rouge_l("The cat sat on the mat.", "the cat lay on the mat") == pytest.approx(5 / 6)
    # P = 2/2, R = 2/4 -> F = 2PR / (P + R) = 2/3
    assert rouge_l("cat mat", "the cat the mat") == pytest.approx(2 / 3)
    assert rouge_l("identical words here", "Identical, words here!") == 1.0
    assert rouge_l("", "anything") == 0.0 and rouge_l("x y", "z") == 0.0


def test_token_f1_follows_squad_normalization():
    assert token_f1("The Eiffel Tower!", "eiffel tower") == 1.0  # case, punctuation and articles ignored
    # prediction 4 tokens, reference 2, overlap 2 -> P = 1/2, R = 1, F = 2/3
    assert token_f1("in the year 1932 maybe", "1932 year") == pytest.approx(2 / 3)
    assert token_f1("no overlap", "something else") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("word", "") == 0.0


def test_exact_match_compares_code_not_wrapping():
    code = "def f(x):\n    return x + 1\n"
    assert exact_match(f"```python\n{code}```", code) == 1.0
    assert exact_match(f"Here you go:\n```python\n{code}```\nDone.", f"```python\n{code}```") == 1.0
    assert exact_match(code.replace("\n", "   \n") + "\n\n", code) == 1.0  # trailing whitespace, blank lines
    assert exact_match(code.replace("x + 1", "x + 2"), code) == 0.0
    assert exact_match(code + "```", code) == 1.0  # a closing fence the model never opened


def test_extract_code_takes_the_first_block_or_an_unterminated_one():
    assert extract_code("a\n```py\none\n```\n```\ntwo\n```") == "one\n"
    assert extract_code("```\nstill writing") == "still writing"
    assert extract_code("plain text") == "plain text"


def test_score_picks_the_metric_by_task():
    assert score("summarization", "a b", "a b") == ("rouge_l", 1.0)
    assert score("rag", "1932", "1932") == ("token_f1", 1.0)
    assert score("code_edit", "x", "y") == ("exact_match", 0.0)
    assert score("summarization", "a", None) == (None, None)
    assert score("multi_turn", "a", "a") == (None, None)
