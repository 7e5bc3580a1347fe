"""Prompts for rows that bring their parts instead of a prompt: a `document` to edit (with an `instruction` per row
or one for the whole run) or a `question` to answer from a `context`."""

from __future__ import annotations

from specdec_core.errors import BadRequestError

EDIT_TEMPLATE = "{instruction}\nReturn the complete edited document and nothing else.\n\nDocument:\n{document}"
QUESTION_TEMPLATE = "Answer the question using the passages.\n\nPassages:\n{context}\n\nQuestion: {question}"


DEFAULT_MAX_CONTEXT_CHARS = 6000


def compose_prompt(row: dict, instruction: str | None = None,
                   max_context_chars: int = DEFAULT_MAX_CONTEXT_CHARS) -> str:
    """The prompt text of a `document` or `question` row (a row's own instruction wins over the run's).

    Only the first max_context_chars of the context go into the prompt, or the row's `prompt_context` where the
    CompressContext stage put one (those characters, compressed); the whole context still reaches drafters that draw
    from it (they read the `context` column).
    """
    if row.get("document") is not None:
        instruction = row.get("instruction") or instruction
        if not instruction or not instruction.strip():
            raise BadRequestError("no edit instruction: give the row an 'instruction' or the job --instruction")
        if not row["document"].strip():
            raise BadRequestError("empty document: nothing to edit")
        return EDIT_TEMPLATE.format(instruction=instruction.strip(), document=row["document"])
    if row.get("question") is not None:
        if not row["question"].strip():
            raise BadRequestError("empty question")
        if not row.get("context") or not row["context"].strip():
            raise BadRequestError("a 'question' row needs a 'context' to answer from")
        shown = row["prompt_context"] if row.get("prompt_context") is not None else row["context"][:max_context_chars]
        return QUESTION_TEMPLATE.format(context=shown, question=row["question"].strip())
    raise BadRequestError("missing column: the row needs 'prompt', 'messages', 'document' or 'question'")
