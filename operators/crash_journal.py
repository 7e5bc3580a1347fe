"""Poison-row isolation: what the decode actors tried before their process died, kept outside them.

A row that kills its worker (out of memory, a native crash) would be retried forever by Ray Data's default actor
pool (unbounded restarts and task retries). Instead every decode call tells this journal -- a small actor of the
driver's, so it outlives any decode actor -- which batch it starts. A batch that is started for the
`BATCH_ATTEMPTS + 1`-th time has crashed its worker that often, so it is redone one (request, method) unit at a
time: each unit is marked as started before it is decoded and its output rows are kept here when it finishes. A
unit found started on the next attempt is the one that crashed the worker: it gets error rows and is never tried
again. So every crash records progress, and a batch of R rows and M methods can crash its workers at most
BATCH_ATTEMPTS + R * M times (`max_task_retries` in the pipeline follows from that bound).
"""

from __future__ import annotations

import hashlib

BATCH_ATTEMPTS = 2  # whole-batch attempts before isolating units: one crash may be a lost node, not a poison row


def batch_key(rows: list[dict], methods: list[str]) -> str:
    """The same rows and methods -> the same key, whichever actor a retry lands on."""
    digest = hashlib.sha256("\t".join(methods).encode())
    for row in rows:
        digest.update(b"\n" + str(row["id"]).encode("utf-8", "replace"))
        todo = row.get("todo_methods")  # a numpy array from the Arrow block, or None
        digest.update(b"\t" + ",".join([] if todo is None else list(todo)).encode())
    return digest.hexdigest()[:24]


def max_task_retries(rows_per_call: int, methods: int) -> int:
    """Attempts one decode call may need when every crash is recorded progress (module docstring). A call may hold
    two batches (Ray Data cuts a call's input into batches of rows_per_call; the prompt stage may leave a call short
    of one, so the next fills it), and each crash is progress of one of them. The pipeline sends an actor one call
    at a time, so no call queued behind a poison one dies with it."""
    return 2 * (BATCH_ATTEMPTS + rows_per_call * methods)


class CrashJournal:
    """Ray actor (created by the driver, zero CPUs): attempt counts of batches, and the units of isolated batches."""

    def __init__(self):
        self.attempts: dict[str, int] = {}
        self.units: dict[str, dict[str, list[dict] | None]] = {}  # batch -> unit -> rows (None: started)

    def begin_batch(self, key: str) -> int:
        """-> how many times this batch was started before (each earlier start ended with its worker's death)."""
        before = self.attempts.get(key, 0)
        self.attempts[key] = before + 1
        return before

    def begin_unit(self, key: str, unit: str) -> tuple[str, list[dict] | None]:
        """-> ("new", None) and the unit is marked started; ("crashed", None) if it was started and never finished;
        ("done", rows) if it finished on an earlier attempt."""
        units = self.units.setdefault(key, {})
        if unit not in units:
            units[unit] = None
            return "new", None
        rows = units[unit]
        return ("crashed", None) if rows is None else ("done", rows)

    def finish_unit(self, key: str, unit: str, rows: list[dict]) -> None:
        self.units.setdefault(key, {})[unit] = rows

    def end_batch(self, key: str) -> None:
        self.attempts.pop(key, None)
        self.units.pop(key, None)
