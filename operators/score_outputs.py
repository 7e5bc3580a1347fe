"""Columns derived from a finished output: its quality against the row's `reference` and, for edits, a unified diff
of the output against the input `document`."""

from __future__ import annotations

import difflib

from analysis.quality import extract_code, score


def edited_document(document: str, output_text: str) -> str:
    """The edited document inside an output: models wrap edits in a code fence, unless the input itself had one."""
    return output_text if "```" in document else extract_code(output_text)


def document_diff(document: str, output_text: str) -> str:
    """Unified diff input -> output ('' when the model changed nothing)."""
    before = document.splitlines(keepends=True)
    after = edited_document(document, output_text).splitlines(keepends=True)
    # Without a final newline difflib glues the next header onto the last line.
    before = [line if line.endswith("\n") else line + "\n" for line in before]
    after = [line if line.endswith("\n") else line + "\n" for line in after]
    return "".join(difflib.unified_diff(before, after, fromfile="input", tofile="output"))


def output_annotations(row: dict, output_text: str) -> dict:
    """quality_metric / quality (None without a reference) and diff (None without a document) for one output."""
    metric, value = score(row.get("task"), output_text, row.get("reference"))
    document = row.get("document")
    return {"quality_metric": metric, "quality": value,
            "diff": document_diff(document, output_text) if document is not None else None}
