"""Resume filter, applied by the prompt stage (the one light actor right after reading, before any tokenizing):
drops requests whose every method is done in the run being resumed and lists the methods still to do on the others
(`todo_methods`), so decode actors never see the done set. Only that actor holds the set, whatever the number of
decode actors, and a set lookup per (request, method) keeps the filter linear in the input. A separate filter actor
was tried: its quarter CPU deadlocked a 2-CPU cluster (decode actor 1.5 + prompt actor 0.25 + read and write tasks).
"""

from __future__ import annotations

import json


def final_request_id(row: dict) -> str:
    """The request id of a row's last output row: a multi-turn request is done when its last turn is."""
    later_turns = json.loads(row["next_turns"]) if row.get("next_turns") else []
    return f"{row['id']}#t{len(later_turns) + 1}" if later_turns else row["id"]


def todo_methods(row: dict, done: frozenset[str], methods: list[str]) -> list[str]:
    """The methods a request still needs: those whose (final request id, method) pair is not done."""
    final = final_request_id(row)
    return [m for m in methods if f"{final}\t{m}" not in done]
