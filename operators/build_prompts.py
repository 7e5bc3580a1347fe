"""Prompt stage: apply the task template and chat template, count prompt tokens, flag unusable prompts.

Runs with the tokenizer only (no weights), so decode actors spend their time decoding.
"""

from __future__ import annotations

import hashlib
import json

from specdec_core.errors import SpecbatchError
from specdec_core.model.model_registry import resolve_model_path
from specdec_core.prompts import build_prompt_ids

from .requests_schema import batch_rows, requests_table
from .skip_done import todo_methods
from .task_prompts import compose_prompt


class SeenIds:
    """Which request ids the run has seen, and at which input positions: the n-th row with an id becomes request
    "ID#dup-n" with an error, not a second decode of ID that the speed-up view would count twice or a resume would
    mistake for the first row's output. In a Ray job a small actor of the driver's (pipelines/generate.py), so a
    restarted prompt actor does not start over with an empty table, and a row read again (a retried batch) keeps
    the rank it got: it is the same position, not a second row."""

    def __init__(self):
        # id digest -> the position digest of its one row so far, or {position digest: rank} once it has several
        self.seen: dict[bytes, bytes | dict[bytes, int]] = {}

    def claim(self, rows: list[tuple[bytes, bytes | None]]) -> list[int]:
        """(id digest, position digest or None: a row without a position is always a new one) per row -> its rank
        among the rows with its id, 1 for the first."""
        ranks = []
        for digest, position in rows:
            known = self.seen.get(digest)
            if known is None:
                self.seen[digest] = position if position is not None else {b"": 1}
                ranks.append(1)
                continue
            if not isinstance(known, dict):
                known = self.seen[digest] = {known: 1}
            if position is None or position not in known:
                position = position if position is not None else len(known).to_bytes(8, "little") + b"#"
                known[position] = len(known) + 1
            ranks.append(known[position])
        return ranks


def _digest(text) -> bytes:
    return hashlib.blake2b(str(text).encode("utf-8", "replace"), digest_size=8).digest()


class BuildPrompts:
    """Ray Data callable class: requests (pandas) -> requests (Arrow) with prompt_ids / prompt_tokens filled."""

    def __init__(self, model: str, task_template: str | None = None, max_prompt_tokens: int | None = None,
                 instruction: str | None = None, max_context_chars: int = 6000, default_task: str | None = None,
                 done: frozenset[str] = frozenset(), methods: list[str] | None = None,
                 max_context_tokens: int = 1 << 20, seen_ids=None):
        """seen_ids: the run's SeenIds actor (a Ray actor handle); None keeps a table of this stage's own."""
        from transformers import AutoConfig, AutoTokenizer


        path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        # A prompt must leave the model room for one new token; --max-prompt-tokens may ask for less.
        self.model_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.max_prompt_tokens = min(max_prompt_tokens or self.model_context, self.model_context)
        self.max_context_tokens = max_context_tokens  # the drafters' context: no model limit, a memory one
        # No token is longer than this many characters, so a text longer than limit x this has more than `limit`
        # tokens: refused before tokenizing it (a multi-GB row would exhaust the tokenizer's memory first).
        self.chars_per_token = max(len(token) for token in self.tokenizer.get_vocab())
        self.seen_ids = seen_ids if seen_ids is not None else SeenIds()
        self.task_template = task_template
        self.instruction = instruction
        self.max_context_chars = max_context_chars
        self.default_task = default_task
        self.done = done  # --resume: "request_id\tmethod" pairs the run already has (operators/skip_done.py)
        self.methods = methods

    def prompt_text(self, row: dict) -> str:
        """The final user prompt of a row without messages: its prompt in the task template, or one composed from
        its document / question."""
        if row.get("prompt") is not None:
            return self.task_template.format(prompt=row["prompt"]) if self.task_template else row["prompt"]
        return compose_prompt(row, self.instruction, self.max_context_chars)

    def prompt_ids(self, row: dict) -> list[int]:
        if row.get("messages"):
            return build_prompt_ids(self.tokenizer, messages=json.loads(row["messages"]))
        return build_prompt_ids(self.tokenizer, prompt=row["prompt"])

    def mark_duplicates(self, rows: list[dict]) -> None:
        """Rows whose id an earlier row of the input had get an error and the id "ID#dup-n" (this is the pipeline's
        one prompt stage: every row passes here)."""
        claims = [(_digest(row["id"]), _digest(row["position"]) if row.get("position") else None) for row in rows]
        claim = self.seen_ids.claim
        if hasattr(claim, "remote"):  # the run's actor
            import ray

            ranks = ray.get(claim.remote(claims))
        else:
            ranks = claim(claims)
        for row, rank in zip(rows, ranks):
            if rank > 1:
                row["input_error"] = f"duplicate id {row['id']!r}: row {rank} with this id in the input"
                row["id"] = f"{row['id']}#dup-{rank}"

    def tokenize(self, row: dict) -> None:
        """Fill prompt_ids / prompt_tokens and context_ids, or input_error for a prompt or context over its limit."""
        if not row.get("messages"):
            # The final prompt text is stored: later turns of a multi-turn row build on it.
            row["prompt"] = self.prompt_text(row)
        chars = (sum(len(m["content"]) for m in json.loads(row["messages"])) if row.get("messages")
                 else len(row["prompt"]))
        if chars > self.chars_per_token * self.max_prompt_tokens:
            row["input_error"] = (f"prompt has {chars} characters, certainly over the limit of "
                                  f"{self.max_prompt_tokens} tokens (--max-prompt-tokens)")
            return
        ids = self.prompt_ids(row)
        row["prompt_tokens"] = len(ids)
        if len(ids) > self.max_prompt_tokens or len(ids) >= self.model_context:
            row["input_error"] = (f"prompt has {len(ids)} tokens, over the limit of {self.max_prompt_tokens} "
                                  "(--max-prompt-tokens, below the model's context)")
            return
        if row.get("context"):
            if len(row["context"]) > self.chars_per_token * self.max_context_tokens:
                row["input_error"] = (f"context has {len(row['context'])} characters, certainly over the limit of "
                                      f"{self.max_context_tokens} tokens (--max-context-tokens)")
                return
            # Tokenized once per request, here: every method's copy drafter may read it.
            context_ids = self.tokenizer(row["context"], add_special_tokens=False)["input_ids"]
            if len(context_ids) > self.max_context_tokens:
                row["input_error"] = (f"context has {len(context_ids)} tokens, over the limit of "
                                      f"{self.max_context_tokens} (--max-context-tokens)")
                return
            row["context_ids"] = context_ids
        row["prompt_ids"] = ids

    def __call__(self, batch):
        rows = []
        batch = batch_rows(batch)
        self.mark_duplicates(batch)  # before the resume filter: a duplicate's own id is what was written
        for row in batch:
            if self.done:
                row["todo_methods"] = todo_methods(row, self.done, self.methods)
                if not row["todo_methods"]:
                    continue
            row["prompt_ids"] = None
            row["context_ids"] = None
            row["task"] = row.get("task") or self.default_task
            if not row.get("input_error"):
                try:
                    self.tokenize(row)
                except SpecbatchError as exc:
                    row["input_error"] = str(exc)
                except Exception as exc:  # a tokenizer/template failure on one row must not stop the job
                    row["input_error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
        return requests_table(rows)
