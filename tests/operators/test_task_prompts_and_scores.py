"""Prompt composition for document / question rows, normalization of those columns, and the per-row edit diff."""

import pytest

from operators.requests_schema import normalize_row
from operators.score_outputs import document_diff, output_annotations
from operators.task_prompts import compose_prompt
from specdec_core.errors import BadRequestError

DOCUMENT = "line one\nline two\nline three\n"


def test_edit_prompt_uses_the_row_instruction_before_the_run_one():
    prompt = compose_prompt({"document": DOCUMENT, "instruction": "Row says."}, instruction="Run says.")
    assert prompt.startswith("Row says.") and DOCUMENT in prompt
    assert compose_prompt({"document": DOCUMENT}, instruction="Run says.").startswith("Run says.")


@pytest.mark.parametrize("row, fragment", [
    ({"document": DOCUMENT}, "no edit instruction"),
    ({"document": "  ", "instruction": "x"}, "empty document"),
    ({"question": "Why?"}, "needs a 'context'"),
    ({"question": " ", "context": "c"}, "empty question"),
    ({}, "missing column"),
])
def test_unusable_rows_raise_a_clear_error(row, fragment):
    with pytest.raises(BadRequestError, match=fragment):
        compose_prompt(row)


def test_question_prompt_truncates_the_context_only_in_the_prompt():
    row = {"question": "Who?", "context": "x" * 100}
    prompt = compose_prompt(row, max_context_chars=10)
    assert "x" * 10 in prompt and "x" * 11 not in prompt and prompt.endswith("Question: Who?")


def test_normalize_accepts_document_and_question_rows():
    assert normalize_row({"id": "d", "document": DOCUMENT, "instruction": "Edit."})["input_error"] is None
    assert normalize_row({"id": "q", "question": "Q?", "context": "C"})["input_error"] is None
    assert "missing column" in normalize_row({"id": "n", "instruction": "Edit."})["input_error"]
    assert "UTF-8" in normalize_row({"id": "b", "document": b"caf\xe9"})["input_error"]


def test_diff_shows_only_the_changed_line_and_reads_inside_fences():
    diff = document_diff(DOCUMENT, "```\nline one\nline 2\nline three\n```\nI changed one line.")
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == ["-line two", "+line 2"]
    assert document_diff(DOCUMENT, DOCUMENT) == ""
    # No final newline on the output: the last line still ends before the next diff line.
    assert "+line 3\n" in document_diff(DOCUMENT, "line one\nline two\nline 3")


def test_annotations_score_references_and_diff_documents():
    row = {"task": "code_edit", "document": DOCUMENT, "reference": DOCUMENT}
    notes = output_annotations(row, DOCUMENT)
    assert notes == {"quality_metric": "exact_match", "quality": 1.0, "diff": ""}
    assert output_annotations({"task": "summarization"}, "text") == {"quality_metric": None, "quality": None,
                                                                     "diff": None}


def test_max_new_tokens_must_be_a_positive_whole_number():
    """Refused, not coerced: 3.7 would become 3 and true 1; Infinity, 1e400 and 2^63 would fail the whole block."""
    import json

    import numpy as np

    from operators.requests_schema import requests_table

    for bad in (3.7, True, "12", float("inf"), json.loads("1e400"), 2**63, 0, -4, None.__class__):
        row = normalize_row({"id": "x", "prompt": "hi", "max_new_tokens": bad})
        assert "max_new_tokens" in (row["input_error"] or ""), bad
        assert row.get("max_new_tokens") is None
        requests_table([row])  # the block still builds
    for good, expected in ((12, 12), (12.0, 12), (np.int64(7), 7), (np.float64(5.0), 5)):
        row = normalize_row({"id": "x", "prompt": "hi", "max_new_tokens": good})
        assert row["input_error"] is None and row["max_new_tokens"] == expected


def test_a_lone_surrogate_is_an_error_row_not_a_failed_block():
    import json

    from operators.requests_schema import requests_table

    for raw in ('{"id": "s", "prompt": "caf\\ud800"}', '{"id": "s", "messages": [{"role": "user", "content": "\\udfff"}]}',
                '{"id": "\\ud800", "prompt": "fine"}'):
        row = normalize_row(json.loads(raw))
        assert "lone UTF-16 surrogate" in row["input_error"], raw
        requests_table([row])  # Arrow stores the row (its id included)
    assert normalize_row({"id": "ok", "prompt": "café 😀"})["input_error"] is None


def test_messages_with_an_unknown_role_or_non_text_content_are_error_rows():
    ok = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    assert normalize_row({"id": "ok", "messages": ok})["input_error"] is None
    bad_role = normalize_row({"id": "r", "messages": [{"role": "robot", "content": "beep"}]})["input_error"]
    assert "message 1 has role 'robot'" in bad_role and "system, user, assistant" in bad_role
    assert "content as a string" in normalize_row({"id": "c", "messages": [{"role": "user", "content": 5}]})[
        "input_error"]


def test_prompt_stage_flags_duplicate_ids_and_prompts_or_contexts_over_their_token_limits():
    """The prompt stage (tokenizer only): the second row with an id is an error naming it; --max-prompt-tokens and
    --max-context-tokens turn an over-long row into an error row; the context is tokenized once, here."""
    import pandas as pd

    from operators.build_prompts import BuildPrompts

    stage = BuildPrompts("smollm2-135m", max_prompt_tokens=120, max_context_tokens=30, max_context_chars=40)
    rows = [normalize_row(r) for r in [
        {"id": "a", "prompt": "Say hi."},
        {"id": "a", "prompt": "Say hi again."},
        {"id": "long", "prompt": "word " * 150},
        {"id": "q", "question": "What is it?", "context": "It is a cat. " * 2},
        {"id": "big-context", "question": "What is it?", "context": "It is a cat. " * 20},
        {"id": "huge", "prompt": "x" * (stage.chars_per_token * 120 + 1)},  # refused before tokenizing
    ]]
    out = {(r["id"], i): r for i, r in enumerate(stage(pd.DataFrame(rows)).to_pylist())}
    assert out[("a", 0)]["input_error"] is None and out[("a", 0)]["prompt_tokens"] > 0
    assert out[("a#dup-2", 1)]["input_error"] == "duplicate id 'a': row 2 with this id in the input"
    assert "over the limit of 120 (--max-prompt-tokens" in out[("long", 2)]["input_error"]
    assert out[("long", 2)]["prompt_ids"] is None
    assert out[("q", 3)]["input_error"] is None and out[("q", 3)]["context_ids"] == stage.tokenizer(
        "It is a cat. " * 2, add_special_tokens=False)["input_ids"]
    assert "over the limit of 30 (--max-context-tokens)" in out[("big-context", 4)]["input_error"]
    assert "certainly over the limit of 120 tokens" in out[("huge", 5)]["input_error"]
    # the limit is never above the model's own context
    assert BuildPrompts("smollm2-135m", max_prompt_tokens=10**9).max_prompt_tokens == 8192


def test_a_restarted_prompt_stage_still_knows_the_runs_ids_and_a_retried_row_is_not_its_own_duplicate():
    """The seen-ids table outlives the prompt stage (in a job, an actor of the driver's): a fresh stage on the same
    table flags the second row with a seen id, and a batch read again (a retry after the stage's actor died) keeps
    its ranks, because its rows have the same input positions."""
    import pandas as pd

    from operators.build_prompts import BuildPrompts, SeenIds

    def batch(*rows):
        return pd.DataFrame([{**normalize_row({"id": row_id, "prompt": "Say hi."}), "position": position}
                             for row_id, position in rows])

    table = SeenIds()
    first = BuildPrompts("smollm2-135m", seen_ids=table)
    ids = [r["id"] for r in first(batch(("a", "in.jsonl:1"), ("b", "in.jsonl:2"))).to_pylist()]
    assert ids == ["a", "b"]
    restarted = BuildPrompts("smollm2-135m", seen_ids=table)  # the first stage's actor died
    again = restarted(batch(("a", "in.jsonl:1"), ("b", "in.jsonl:2"))).to_pylist()  # its batch, retried
    assert [(r["id"], r["input_error"]) for r in again] == [("a", None), ("b", None)]
    later = restarted(batch(("c", "in.jsonl:3"), ("a", "in.jsonl:4"), ("a", "other.jsonl:1"))).to_pylist()
    assert [(r["id"], r["input_error"]) for r in later] == [
        ("c", None), ("a#dup-2", "duplicate id 'a': row 2 with this id in the input"),
        ("a#dup-3", "duplicate id 'a': row 3 with this id in the input")]
    assert SeenIds().claim([(b"x" * 8, None), (b"x" * 8, None)]) == [1, 2]  # rows without a position: each new


def test_every_input_row_carries_its_position_in_the_input(tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    from operators.read_requests import normalize_batch, parse_jsonl_file, parse_parquet_file

    lines = parse_jsonl_file({"path": "in.jsonl", "bytes": b'{"id": "a", "prompt": "x"}\n\n{"id": "b"}\n'})
    assert [r["position"] for r in lines] == ["in.jsonl:1", "in.jsonl:3"]
    pq.write_table(pa.table({"id": ["p", "q"], "prompt": ["x", "y"]}), tmp_path / "t.parquet")
    records = parse_parquet_file({"path": str(tmp_path / "t.parquet")})
    assert [r["position"] for r in records] == [f"{tmp_path / 't.parquet'}:0:0", f"{tmp_path / 't.parquet'}:0:1"]
    normalized = normalize_batch(pd.DataFrame(lines + records)).to_pylist()
    assert [(r["id"], r["position"]) for r in normalized] == [
        ("a", "in.jsonl:1"), ("b", "in.jsonl:3"), ("p", records[0]["position"]), ("q", records[1]["position"])]
