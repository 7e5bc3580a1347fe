"""Shipped workload loaders: every row follows the input contract; expected outputs are what they claim."""

import re

import pytest

from corpora.aclsum import rag_rows, summarization_rows
from corpora.code_edit import humaneval_rows, rename_identifier, stdlib_rename_tasks
from corpora.mt_redundant import SECOND_TURNS
from corpora.mtbench import mtbench_rows, open_question_rows


def assert_input_contract(rows):
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "ids must be unique"
    for row in rows:
        assert isinstance(row["id"], str) and row["id"]
        # Exactly one way to the prompt: a ready prompt, chat messages, or a question (composed with its context).
        ways = [bool(row.get(name)) for name in ("prompt", "messages", "question")]
        assert ways.count(True) == 1, row["id"]
        if row.get("question"):
            assert row.get("context"), row["id"]


def test_rename_identifier_touches_names_only():
    source = 'def f(tag):\n    x = obj.tag + tag  # tag\n    return "tag", tag\n'
    assert rename_identifier(source, "tag", "label") == (
        'def f(label):\n    x = obj.tag + label  # tag\n    return "tag", label\n'
    )


def test_stdlib_rename_tasks_are_varied_and_checkable():
    tasks = stdlib_rename_tasks(10)
    assert len(tasks) == 10
    assert_input_contract(tasks)
    for task in tasks:
        old, new = re.search(r"Rename the variable `(\w+)` to `(\w+)`", task["prompt"]).groups()
        code = task["prompt"].split("```python\n", 1)[1]
        assert 60 <= code.count("\n") <= 151
        assert task["reference"] == "```python\n" + rename_identifier(code.removesuffix("```"), old, new) + "```"
        assert new in task["reference"]


def test_stdlib_rename_tasks_reach_a_benchmark_size_and_keep_their_first_picks():
    many = stdlib_rename_tasks(64)
    assert len(many) == 64
    assert_input_contract(many)
    assert [t["id"] for t in many[:10]] == [t["id"] for t in stdlib_rename_tasks(10)]  # round robin: stable prefix
    assert len({t["id"].split(".")[0] for t in many[:32]}) >= 20  # one function per module first


def test_stdlib_rename_tasks_reach_a_queue_of_256_past_the_first_tier():
    """Past the module-level functions (the first tier: 71 on CPython 3.11, built alone for up to that many and
    unchanged by the second), classes' methods and further modules give the few hundred code edits a batch job's
    queue needs, no prompt twice (a repeated prompt would hand the job memory its answer); each row's reference is
    the rename of its code."""
    many = stdlib_rename_tasks(256)
    assert len(many) == 256 and len({t["id"] for t in many}) == 256 and len({t["prompt"] for t in many}) == 256
    assert [t["id"] for t in many[:71]] == [t["id"] for t in stdlib_rename_tasks(71)]
    assert_input_contract(many)
    for task in many[::15]:
        old, new = re.search(r"Rename the variable `(\w+)` to `(\w+)`", task["prompt"]).groups()
        code = task["prompt"].split("```python\n", 1)[1].removesuffix("```")
        assert 60 <= code.count("\n") <= 151
        assert task["reference"] == "```python\n" + rename_identifier(code, old, new) + "```"


def test_humaneval_rows_cover_all_problems_and_edit_kinds():
    rows = humaneval_rows()
    assert len(rows) == 164
    assert_input_contract(rows)
    assert {r["edit"] for r in rows} == {"rename", "docstring", "loop_style"}
    assert all((r["reference"] is not None) == (r["edit"] == "rename") for r in rows)


def test_summarization_rows_have_references():
    rows = summarization_rows(5)
    assert len(rows) == 5
    assert_input_contract(rows)
    assert all(len(r["prompt"]) > 2000 and r["reference"] for r in rows)
    assert len(summarization_rows()) == 100


def test_rag_rows_carry_the_whole_paper_as_context():
    rows = rag_rows(6)
    assert len(rows) == 6
    assert_input_contract(rows)
    assert all(len(r["context"]) > 6000 and r["question"].endswith("?") and "prompt" not in r for r in rows)
    assert {r["id"].rsplit("-", 1)[1] for r in rows} == {"challenge", "approach", "outcome"}


def test_mtbench_rows_have_a_redundant_second_turn():
    rows = mtbench_rows()
    assert len(rows) == 80
    assert_input_contract(rows)
    for row in rows:
        assert row["messages"][0]["role"] == "user"
        assert row["next_turns"] == [SECOND_TURNS[int(row["id"].split("-")[1])]]
    # One second turn written per question: all 80 differ, and each asks to repeat or revise the first answer.
    assert len({row["next_turns"][0] for row in rows}) == 80
    assert all(t.startswith(("Repeat", "Revise", "Rewrite", "Keep", "Restate")) for t in SECOND_TURNS.values())


def test_open_questions_are_first_turns_without_a_next_turn():
    rows = open_question_rows(40)
    assert len(rows) == 40
    assert_input_contract(rows)
    firsts = {r["id"]: r["messages"] for r in mtbench_rows(40)}
    assert all(r["messages"] == firsts[r["id"]] and "next_turns" not in r for r in rows)


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_limits_are_respected(limit):
    assert len(mtbench_rows(limit or None)) == (limit or 80)
    if limit:
        assert len(rag_rows(limit)) == limit and len(humaneval_rows(limit)) == limit
