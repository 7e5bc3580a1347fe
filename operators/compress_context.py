"""Compression stage (only with --compress-context R): a `question` row's prompt carries its context compressed R x.

Runs before the prompt stage, on its own actor with a scoring model (context_compressor.py), so the prompt stage stays
tokenizer-only. The compressor reads the first --max-context-chars of the context (what the prompt would carry
uncut) and keeps 1/R of its tokens; the question and the `context` column (the copy drafters' source) are untouched.
"""

from __future__ import annotations

from .context_compressor import SelfInformationCompressor
from .requests_schema import batch_rows, requests_table


class CompressContext:
    """Ray Data callable class: requests (pandas) -> requests (Arrow) with `prompt_context` set on question rows."""

    def __init__(self, model: str, ratio: float, max_context_chars: int = 6000, dtype: str = "auto",
                 torch_threads: int = 1):
        import torch

        from specdec_core.model.model_runner import ModelRunner  # lazy: torch, in the actor only


        torch.set_num_threads(torch_threads)
        runner = ModelRunner.load(model, dtype=dtype, device="cpu")
        self.compressor = SelfInformationCompressor(runner.model, runner.tokenizer)
        self.ratio, self.max_context_chars = ratio, max_context_chars

    def compress_row(self, row: dict) -> None:
        if row.get("input_error") or row.get("question") is None or row.get("prompt") is not None \
                or row.get("messages") or not (row.get("context") or "").strip():
            return  # only rows whose prompt is composed from question + context (task_prompts.py)
        try:
            row["prompt_context"] = self.compressor.compress(row["context"][: self.max_context_chars], self.ratio)
        except Exception as exc:  # one row's failure is that row's error, never the job's
            row["input_error"] = f"context compression failed: {type(exc).__name__}: {exc}"

    def __call__(self, batch):
        rows = batch_rows(batch)
        for row in rows:
            self.compress_row(row)
        return requests_table(rows)
