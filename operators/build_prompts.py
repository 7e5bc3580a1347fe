"""Prompt stage: apply the task template and chat template, count prompt tokens, flag unusable prompts.

Runs with the tokenizer only (no weights), so decode actors spend their time decoding.
"""

from __future__ import annotations

import hashlib
import json

from .requests_schema import requests_table
from .skip_done import todo_methods
from .task_prompts import compose_prompt


class BuildPrompts:
    """Ray Data callable class: requests (pandas) -> requests (Arrow) with prompt_ids / prompt_tokens filled."""

    def __init__(self, model: str, task_template: str | None = None, max_prompt_tokens: int | None = None,
                 instruction: str | None = None, max_context_chars: int = 6000, default_task: str | None = None,
                 done: frozenset[str] = frozenset(), methods: list[str] | None = None,
                 max_context_tokens: int = 1 << 20):
        from transformers import AutoConfig, AutoTokenizer

        from specdec_core.model_registry import resolve_model_path

        path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        model_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        # --max-prompt-tokens: one huge row must not exhaust an actor's memory; never past the model's context.
        self.max_prompt_tokens = min(max_prompt_tokens or model_context, model_context)
        self.max_context_tokens = max_context_tokens  # the drafters' context: no model limit, a memory one
        # 8-byte digests of the ids seen so far (this is the pipeline's one prompt actor, so it sees every row):
        # a repeated id is an error row, not a second decode that the speed-up view would count twice.
        self.seen_ids: set[bytes] = set()
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
        from specdec_core.prompts import build_prompt_ids

        if row.get("messages"):
            return build_prompt_ids(self.tokenizer, messages=json.loads(row["messages"]))
        return build_prompt_ids(self.tokenizer, prompt=row["prompt"])

    def tokenize(self, row: dict) -> None:
        """Fill prompt_ids / prompt_tokens and context_ids, or input_error for a prompt or context over its limit."""
        if not row.get("messages"):
            # The final prompt text is stored: later turns of a multi-turn row build on it.
            row["prompt"] = self.prompt_text(row)
        ids = self.prompt_ids(row)
        row["prompt_tokens"] = len(ids)
        if len(ids) >= self.max_prompt_tokens:
            row["input_error"] = (f"prompt has {len(ids)} tokens, over the limit of {self.max_prompt_tokens} "
                                  "(--max-prompt-tokens, at most the model's context)")
            return
        if row.get("context"):
            # Tokenized once per request, here: every method's copy drafter may read it.
            context_ids = self.tokenizer(row["context"], add_special_tokens=False)["input_ids"]
            if len(context_ids) > self.max_context_tokens:
                row["input_error"] = (f"context has {len(context_ids)} tokens, over the limit of "
                                      f"{self.max_context_tokens} (--max-context-tokens)")
                return
            row["context_ids"] = context_ids
        row["prompt_ids"] = ids

    def __call__(self, batch):
        from specdec_core.errors import SpecbatchError

        rows = []
        for row in batch.to_dict("records"):
            row = {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
            if self.done:
                row["todo_methods"] = todo_methods(row, self.done, self.methods)
                if not row["todo_methods"]:
                    continue
            row["prompt_ids"] = None
            row["context_ids"] = None
            row["task"] = row.get("task") or self.default_task
            digest = hashlib.blake2b(str(row["id"]).encode("utf-8", "replace"), digest_size=8).digest()
            if digest in self.seen_ids:
                row["input_error"] = f"duplicate id {row['id']!r}: an earlier row of the input has it"
            self.seen_ids.add(digest)
            if not row.get("input_error"):
                try:
                    self.tokenize(row)
                except SpecbatchError as exc:
                    row["input_error"] = str(exc)
                except Exception as exc:  # a tokenizer/template failure on one row must not stop the job
                    row["input_error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
        return requests_table(rows)
