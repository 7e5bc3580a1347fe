"""Per-row quality metrics against a `reference`: ROUGE-L (summaries), exact match (code edits), token F1 (QA).

Definitions follow the usual references: ROUGE-L is the LCS F-measure over lowercased alphanumeric tokens without
stemming (rouge-score's defaults, beta = 1); token F1 is SQuAD's (lowercase, drop punctuation and articles, bag of
words overlap); exact match compares the code (the first fenced block when there is one) line by line, ignoring
trailing whitespace and blank lines at either end.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str) -> str:
    """The first fenced code block's body when the text has one (models wrap edits in fences), else the text without
    stray fence lines (a model sometimes only closes a fence it never opened)."""
    match = _FENCE.search(text)
    if match:
        return match.group(1)
    return "".join(line for line in text.splitlines(keepends=True) if not line.strip().startswith("```"))


def _normalized_lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def exact_match(prediction: str, reference: str) -> float:
    return float(_normalized_lines(extract_code(prediction)) == _normalized_lines(extract_code(reference)))


def _rouge_tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence by dynamic programming over one row (O(len(a) * len(b)) time, O(len(b)) memory)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    candidate, target = _rouge_tokens(prediction), _rouge_tokens(reference)
    if not candidate or not target:
        return 0.0
    lcs = _lcs_length(candidate, target)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(target)
    return 2 * precision * recall / (precision + recall)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _answer_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def token_f1(prediction: str, reference: str) -> float:
    candidate, target = _answer_tokens(prediction), _answer_tokens(reference)
    if not candidate or not target:
        return float(candidate == target)
    common = sum((Counter(candidate) & Counter(target)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(candidate), common / len(target)
    return 2 * precision * recall / (precision + recall)


QUALITY_METRICS: dict[str, Callable[[str, str], float]] = {
    "rouge_l": rouge_l,
    "exact_match": exact_match,
    "token_f1": token_f1,
}

# Which metric a task's reference is scored with; tasks not listed (e.g. multi_turn) are not scored.
TASK_METRICS = {
    "summarization": "rouge_l",
    "code_edit": "exact_match",
    "edit": "exact_match",
    "rag": "token_f1",
    "qa": "token_f1",
}


def score(task: str | None, prediction: str, reference: str | None) -> tuple[str | None, float | None]:
    """(metric name, value) for one output, or (None, None) when there is no reference or no metric for the task."""
    metric = TASK_METRICS.get(task or "")
    if reference is None or metric is None:
        return None, None
    return metric, QUALITY_METRICS[metric](prediction, reference)
