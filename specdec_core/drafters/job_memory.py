"""Job memory: the outputs a job has decoded so far, as one suffix tree that every row's `suffix` drafter matches
(SuffixDecoding's global tree). A nightly job runs one instruction over thousands of similar documents, so what
earlier rows wrote is the best guess of what the next row writes.

- The engine owns one memory per method (a benchmark's methods never draft from each other's outputs), so a job's
  actor keeps it across all its calls.
- Outputs only: prompts go into each row's own tree, so one long prompt cannot crowd the memory.
- A row's output enters step by step as it is decoded (a step after its commit, while the next step verifies), so
  rows of one batch draft from each other while they run.
- Bounded by `max_tokens`: finished outputs are evicted oldest first, whole. A row still decoding is never
  evicted; while the memory is full of them, new rows' outputs are not added.
- Seeded from earlier runs' `generations` Parquet (`seed_sequences`), newest outputs kept.
Memory only changes what is drafted, never what is emitted: verification keeps every method lossless.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..defaults import DEFAULT_MEMORY_TOKENS
from .suffix_tree import Cursor, SuffixTree
from ..errors import SpecbatchError
from ..model.model_registry import resolve_model_path
from ..prompts import tokenizer_fingerprint

MEMORY_DEPTH = 24  # the suffix trees' depth: vLLM's suffix_decoding_max_tree_depth (see docs/decisions.md)


class MemorySequence:
    """One output in the memory; `append` adds its next token."""

    __slots__ = ("tokens", "cursor", "finished", "dropped")

    def __init__(self, cursor: Cursor) -> None:
        self.tokens: list[int] = []
        self.cursor = cursor
        self.finished = False
        self.dropped = False  # evicted, or never admitted (the memory was full of running rows)


class JobMemory:
    def __init__(self, max_tokens: int = DEFAULT_MEMORY_TOKENS, depth: int = MEMORY_DEPTH):
        if max_tokens < 0:
            raise ValueError(f"the job memory's bound must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tree = SuffixTree(depth)
        self.sequences: deque[MemorySequence] = deque()  # oldest first
        self.evicted = 0  # sequences evicted so far

    @property
    def tokens(self) -> int:
        return self.tree.tokens

    def begin(self) -> MemorySequence:
        sequence = MemorySequence(self.tree.cursor())
        self.sequences.append(sequence)
        return sequence

    def append(self, sequence: MemorySequence, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        while tokens and not sequence.dropped:
            room = self.max_tokens - self.tree.tokens
            if room <= 0:
                if not self._evict_one():
                    self._drop(sequence)  # full of running rows: this one stays out
                continue
            taken, tokens = tokens[:room], tokens[room:]
            self.tree.extend(sequence.cursor, taken)
            sequence.tokens.extend(taken)

    def finish(self, sequence: MemorySequence) -> None:
        sequence.finished = True

    def add(self, tokens: Sequence[int]) -> None:
        """One whole output (seeding)."""
        sequence = self.begin()
        self.append(sequence, tokens)
        self.finish(sequence)

    def seed_sequences(self, outputs: Iterable[Sequence[int]]) -> None:
        """Earlier runs' outputs, oldest first: the newest that fit are kept."""
        for tokens in outputs:
            if len(tokens) <= self.max_tokens:
                self.add(tokens)

    def _evict_one(self) -> bool:
        """Evict the oldest finished sequence -> whether one was."""
        for sequence in self.sequences:
            if sequence.finished and not sequence.dropped:
                self._drop(sequence)
                self.evicted += 1
                return True
        return False

    def _drop(self, sequence: MemorySequence) -> None:
        if sequence.tokens:
            self.tree.remove(sequence.tokens)
        sequence.dropped = True
        sequence.tokens = []
        self.sequences.remove(sequence)


def read_outputs(path: str, tokenizer, model: str, max_tokens: int, missing_ok: bool = False) -> list[list[int]]:
    """The newest error-free outputs of earlier runs under `path` (a job's --output directory, or its generations/)
    that fit in `max_tokens`, oldest first; one output per request (several methods of one run gave the same).
    Outputs of a model whose tokenizer is not `tokenizer` are refused: their token ids mean other text. A nightly
    job seeds from its own --output, which the first night has not written yet (`missing_ok`)."""
    import pyarrow.dataset as pads


    root = Path(path)
    if (root / "generations").is_dir():
        root = root / "generations"
    if not root.exists():
        if missing_ok:
            return []
        raise SpecbatchError(f"--memory-from {path}: no such directory (give a job's --output directory)")
    try:
        table = pads.dataset(str(root), format="parquet", partitioning="hive").to_table(
            columns=["request_id", "model", "output_token_ids", "error", "started_at"])
    except (OSError, ValueError, KeyError) as exc:
        raise SpecbatchError(f"--memory-from {path}: not a job's generations Parquet ({exc})") from None
    rows = [r for r in table.to_pylist() if r["error"] is None and r["output_token_ids"]]
    for other in sorted({r["model"] for r in rows} - {model}):
        if not _same_tokenizer(other, tokenizer):
            raise SpecbatchError(f"--memory-from {path} holds outputs of {other!r}, whose tokenizer is not "
                                 f"{model!r}'s: seed the memory from runs of this model")
    newest: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: (r["started_at"] is not None, r["started_at"])):
        newest.pop(row["request_id"], None)
        newest[row["request_id"]] = row  # (re-inserted: dict order is then the newest's order)
    kept, total = [], 0
    for row in reversed(newest.values()):
        if total + len(row["output_token_ids"]) > max_tokens:
            break
        kept.append(row["output_token_ids"])
        total += len(kept[-1])
    return kept[::-1]


def _same_tokenizer(model: str, tokenizer) -> bool:
    from transformers import AutoTokenizer


    try:
        other = AutoTokenizer.from_pretrained(resolve_model_path(model))
    except Exception:  # not installed here, or not a model at all: its ids cannot be checked
        return False
    return tokenizer_fingerprint(other) == tokenizer_fingerprint(tokenizer)
