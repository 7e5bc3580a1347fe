"""The requests table that flows between stages: input-contract columns normalized to fixed types.

Chat messages and later turns travel as JSON strings so that every block has the same Arrow schema whatever its
rows hold; a row that cannot be used keeps flowing with `input_error` set, so it still gets an output row.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa

REQUESTS_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("task", pa.string()),
    ("prompt", pa.string()),
    ("messages", pa.string()),  # JSON list of {role, content}
    ("next_turns", pa.string()),  # JSON list of user messages decoded after the first turn
    ("context", pa.string()),
    ("prompt_context", pa.string()),  # QA rows under --compress-context: the compressed context the prompt carries
    ("reference", pa.string()),
    ("document", pa.string()),  # edit jobs: the text to edit (the output's diff is taken against it)
    ("instruction", pa.string()),  # edit jobs: this row's edit instruction
    ("question", pa.string()),  # QA jobs: answered from `context`
    ("max_new_tokens", pa.int64()),
    ("input_error", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("prompt_tokens", pa.int64()),
    ("context_ids", pa.list_(pa.int32())),  # the context in the model's tokens: copy drafters' extra source
    ("todo_methods", pa.list_(pa.string())),  # --resume: the methods this request still needs (null: all)
    # Where the row is in the input (FILE:LINE, FILE:GROUP:INDEX, workload:NAME:INDEX, hf:INDEX): the same on every
    # read, so the run's seen-ids table (build_prompts.SeenIds) tells a retried row from a second row with its id.
    ("position", pa.string()),
])


def batch_rows(batch) -> list[dict]:
    """A pandas batch of the requests table -> row dicts, pandas' NaN for a missing value back to None."""
    return [{k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
            for row in batch.to_dict("records")]


def requests_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({f.name: [row.get(f.name) for row in rows] for f in REQUESTS_SCHEMA},
                                schema=REQUESTS_SCHEMA)


def row_hash_id(row: dict) -> str:
    """Stable id for rows that come without one: a hash of their content."""
    payload = json.dumps(row, sort_keys=True, default=str).encode("utf-8", "replace")
    return "row-" + hashlib.sha256(payload).hexdigest()[:16]


def _as_text(value, name: str) -> tuple[str | None, str | None]:
    if value is None:
        return None, None
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), None
        except UnicodeDecodeError:
            return None, f"column {name!r} is not valid UTF-8"
    if isinstance(value, str):
        return value, None
    return None, f"column {name!r} must be a string, got {type(value).__name__}"


def _as_messages(value) -> tuple[str | None, str | None]:
    if value is None:
        return None, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, "column 'messages' is not a JSON list"
    if hasattr(value, "tolist"):  # numpy arrays from Parquet/pandas
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        return None, "column 'messages' must be a list of {role, content}"
    cleaned = [{"role": m.get("role"), "content": m.get("content")} for m in value]
    for number, message in enumerate(cleaned, start=1):
        if message["role"] not in CHAT_ROLES:
            return None, (f"message {number} has role {message['role']!r}; roles are {', '.join(CHAT_ROLES)}")
        if not isinstance(message["content"], str):
            return None, f"message {number} needs its content as a string"
    return json.dumps(cleaned), None


CHAT_ROLES = ("system", "user", "assistant")
MAX_TOKEN_COUNT = 2**31 - 1  # any sane limit; past int64 Arrow would fail the whole block


def _as_token_count(value) -> tuple[int | None, str | None]:
    """A positive whole number, or an error: 3.7, true, "12", Infinity, 1e400 and 2^63 are refused, not coerced
    (int(3.7) == 3 and int(True) == 1 would silently change the request)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "is_integer"):
        return None, f"max_new_tokens must be a whole number, got {value!r}"
    if isinstance(value, float) or hasattr(value, "is_integer"):  # floats, numpy floats
        if value != value or value in (float("inf"), float("-inf")) or not float(value).is_integer():
            return None, f"max_new_tokens must be a whole number, got {value!r}"
    count = int(value)
    if not 1 <= count <= MAX_TOKEN_COUNT:
        return None, f"max_new_tokens must be between 1 and {MAX_TOKEN_COUNT}, got {count}"
    return count, None


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def normalize_row(raw: dict) -> dict:
    """One input row -> the requests schema (without prompt ids); problems go to input_error, never raise."""
    errors = []
    row_id = raw.get("id")
    row = {"id": str(row_id) if row_id not in (None, "") else row_hash_id(raw)}
    if _has_lone_surrogate(raw):
        # JSON may escape half a UTF-16 pair ("\ud800"): that is not text, like invalid UTF-8 it is refused (Arrow
        # cannot even store it, so one such row would fail its whole block).
        if _has_lone_surrogate(row["id"]):
            row["id"] = row_hash_id(raw)
        return {"id": row["id"], "input_error": "the row holds invalid text (a lone UTF-16 surrogate)"}
    for name in ("task", "prompt", "context", "reference", "document", "instruction", "question"):
        row[name], error = _as_text(raw.get(name), name)
        errors.append(error)
    row["messages"], error = _as_messages(raw.get("messages"))
    errors.append(error)
    turns = raw.get("next_turns")
    if hasattr(turns, "tolist"):
        turns = turns.tolist()
    if turns is not None:
        if isinstance(turns, list) and all(isinstance(t, str) for t in turns):
            row["next_turns"] = json.dumps(turns)
        else:
            errors.append("column 'next_turns' must be a list of strings")
    max_new = raw.get("max_new_tokens")
    if max_new is not None and max_new == max_new:  # NaN from pandas means absent
        row["max_new_tokens"], error = _as_token_count(max_new)
        errors.append(error)
    if all(row.get(name) is None for name in ("prompt", "messages", "document", "question")) and not any(errors):
        errors.append("missing column: the row needs 'prompt', 'messages', 'document' or 'question'")
    if raw.get("input_error"):
        errors.insert(0, raw["input_error"])
    row["input_error"] = "; ".join(e for e in errors if e) or None
    return row
