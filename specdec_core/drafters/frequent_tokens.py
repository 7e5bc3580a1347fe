"""A draft model's head over the tokens it is likely to draft: its frequent tokens plus each row's own (the tokens of
its prompt and of its text so far). Frequency-ranked drafting (FR-Spec, Zhao et al. 2025) restricted to frequent
tokens; adding the row's own tokens is ours, and is what makes a small set enough for copy-heavy prompts.

Why: a small drafter's LM head is a large share of its forward, and a head over a tenth of the tokens costs a
small part of it (decisions.md: specdec_core/drafters/frequent_tokens.py). Only what is
proposed changes, never what is accepted: SLEM verifies its draft's text against the target's own choices, so a
drafter that cannot name a rare token merely drafts something else there.

Teacher-forced over code-edit prompts and the target's own outputs, the argmax over the frequent tokens alone
missed the whole head's only at some of the prompt's identifiers (a function name split into pieces the standard
library never uses); with the row's prompt tokens added, never.

Frequent = the tokens the draft tokenizer produces on the Python standard library's own sources (tests left out),
ranked by count and capped at FREQUENT_TOKENS; counted once per tokenizer and cached on disk. The standard
library is the one corpus every machine has; its docstrings and comments carry English too.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from ..defaults import cache_root
from ..model.lm_head import SubsetHead, head_bias_rows, head_rows
from ..model.model_runner import ModelRunner
from ..prompts import tokenizer_fingerprint

FREQUENT_TOKENS = 32_768  # at most this many frequent tokens (the sample has ~25.6k distinct Gemma 3 tokens)
CORPUS_CHARS = 16_000_000  # of standard-library source read (all of it, tests left out: ~11 M characters)
SKIPPED_DIRS = {"site-packages", "test", "tests", "idlelib"}
VERSION = "v1"  # bumped when what is counted changes, so an older cached list is not reused


def standard_library_sources(limit: int = CORPUS_CHARS) -> list[str]:
    """The Python standard library's .py sources (tests and site-packages left out), in path order, to `limit`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS & set(p.relative_to(root).parts)):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def count_tokens(tokenizer, texts: list[str], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each token occurs in the texts' encodings (no special tokens added)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []:
        ids = np.asarray(ids, dtype=np.int64)
        counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def load_or_build_frequent(tokenizer, vocab_size: int, limit: int = FREQUENT_TOKENS,
                           cache_dir: Path | None = None) -> np.ndarray:
    """int64 [<= limit] the tokenizer's most frequent tokens on the standard library (those that occur), by count;
    cached under $SPECBATCH_CACHE/vocab_maps/ by the tokenizer's fingerprint (written atomically)."""
    directory = Path(cache_dir) if cache_dir is not None else cache_root() / "vocab_maps"
    path = directory / f"frequent-{VERSION}-{tokenizer_fingerprint(tokenizer)}-{vocab_size}-{limit}.npy"
    if path.exists():
        return np.load(path)
    counts = count_tokens(tokenizer, standard_library_sources(), vocab_size)
    order = np.argsort(-counts, kind="stable")
    frequent = order[: min(limit, int((counts > 0).sum()))].astype(np.int64)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{path.name}.{os.getpid()}.partial.npy"
    np.save(partial, frequent)
    os.replace(partial, path)
    return frequent


class FrequentTokens:
    """A draft model's frequent tokens (with its special and end tokens) and their head, built once per pool."""

    def __init__(self, runner: ModelRunner, limit: int = FREQUENT_TOKENS):
        ids = set(load_or_build_frequent(runner.tokenizer, runner.vocab_size, limit).tolist())
        ids |= {i for i in runner.tokenizer.all_special_ids if i is not None} | set(runner.eos_token_ids)
        self.ids = torch.tensor(sorted(i for i in ids if 0 <= i < runner.vocab_size))  # [F]
        self.member = torch.zeros(runner.vocab_size, dtype=torch.bool)  # [vocab]
        self.member[self.ids] = True
        self.head = SubsetHead(runner, self.ids)
        self.runner = runner

    def missing(self, tokens) -> set[int]:
        """The tokens of `tokens` (ids) that are not frequent ones."""
        if not tokens:
            return set()
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        ids = ids[(ids >= 0) & (ids < self.member.numel())]
        return set(ids[~self.member[ids]].tolist())

    def head_for_rows(self, own: dict[int, set[int]]) -> "RowTokensHead":
        """own: cache row -> the row's tokens that are not frequent (its prompt's, its text's)."""
        return RowTokensHead(self, own)


@functools.lru_cache(maxsize=4)
def frequent_tokens(runner: ModelRunner) -> FrequentTokens:
    """One FrequentTokens per draft model, not per pool: a job builds a decoder (and a pool) per batch of rows and the
    CLI one per prompt, and building it (the tokenizer's fingerprint, the cached list, the head's rows) was a
    visible share of a short pass."""
    return FrequentTokens(runner)


class RowTokensHead:
    """The head over the frequent tokens plus, for each row, its own tokens: [N, hidden] -> [N, vocab] float32
    logits, -inf elsewhere. Each row sees only its own extra tokens, so a row's drafting distribution (a sampled
    SLEM row's q) does not depend on which rows share its batch."""

    def __init__(self, frequent: FrequentTokens, own: dict[int, set[int]]):
        self.frequent = frequent
        extra = sorted(set().union(*own.values())) if own else []
        self.extra_ids = torch.tensor(extra, dtype=torch.long)  # [E]
        linear = frequent.runner.model.get_output_embeddings()
        self.extra_weight = head_rows(linear, self.extra_ids) if extra else None  # [E, hidden]
        self.extra_bias = head_bias_rows(linear, self.extra_ids) if extra else None  # [E]
        # Which extra tokens each cache row may draft: one [rows, E] mask, built once per flush, read per forward.
        self.row_index = {row: i for i, row in enumerate(own)}
        column = {token: j for j, token in enumerate(extra)}
        self.owned = torch.zeros(len(own), len(extra), dtype=torch.bool)  # [rows, E]
        for i, tokens in enumerate(own.values()):
            self.owned[i, [column[t] for t in tokens]] = True
        self.rows: list[int] = []

    def for_rows(self, rows: list[int]) -> "RowTokensHead":
        """The cache rows of the next call's hidden states, in order (each one a row given in `own`)."""
        self.rows = list(rows)
        return self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        full = self.frequent.head(hidden)  # [N, vocab], -inf off the frequent tokens
        if self.extra_weight is None:
            return full
        extra = self.frequent.head.project(hidden, self.extra_weight, self.extra_bias)  # [N, E]
        owned = self.owned[[self.row_index[row] for row in self.rows]]  # [N, E]
        full[:, self.extra_ids] = extra.masked_fill(~owned, float("-inf"))
        return full
