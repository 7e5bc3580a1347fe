"""The job's one progress bar: requests done / total, new tokens per second and error rows, read from the Parquet
files the run has published (parquet_sink.py) by a driver thread. It replaces Ray Data's per-operator progress
lines, which print every second and flood a nightly job's log."""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq


POLL_S = 2.0  # how often the written files are counted (the bar redraws at its own interval)
GATE_POLL_S = 0.25  # ... until the error gate has decided: error rows need no decoding and come fast
EARLY_ROWS = 100  # the error gate decides once this many rows (or 1 % of the expected rows, if more) are written


@dataclass
class ErrorGate:
    """Stops a job whose errors dominate from its start: once the job has written its first max(EARLY_ROWS, 1 %)
    rows, an error share over `max_fraction` ends it (`stop` is called: parquet_sink.request_stop). Decided once: a
    job whose early rows are fine finishes, whatever comes later (its exit status still reads the final share)."""

    max_fraction: float
    expected_rows: int
    stop: "object" = None  # called when the gate stops the job
    decided: bool = False

    def __post_init__(self) -> None:
        # a job expected to write fewer rows never reaches the gate: the progress thread polls at its slow rate
        self.decided = self.decided or self.expected_rows < self.early_rows

    @property
    def early_rows(self) -> int:
        return max(EARLY_ROWS, math.ceil(0.01 * self.expected_rows))

    def stops(self, rows: int, errors: int) -> bool:
        if self.decided or rows < self.early_rows:
            return False
        self.decided = True
        return errors > self.max_fraction * rows


class RunProgress:
    """Counts the part files under a run directory as they appear; each file is read once (3 small columns)."""

    def __init__(self, run_dir: str | Path, total: int | None, interval_s: float | None = None,
                 gate: ErrorGate | None = None):
        self.run_dir = Path(run_dir)
        self.total = total
        # On a terminal the bar redraws often; in a log file each redraw is text, so far fewer.
        self.interval_s = interval_s or (2.0 if sys.stderr.isatty() else 30.0)
        self.gate = gate
        self.stopped: tuple[int, int] | None = None  # (rows, errors) this job had written when the gate stopped it
        self.seen: set[Path] = set()
        self.requests = self.errors = self.tokens = self.rows = 0
        self._rows_before = self._errors_before = 0  # --resume: the gate reads this job's rows only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.perf_counter()
        self._bar = None
        self._tokens_before = 0  # --resume: tokens the run already had do not count toward this job's rate

    def poll(self) -> None:
        for path in sorted(self.run_dir.glob("method=*/part-*.parquet")):
            if path in self.seen:
                continue
            try:
                table = pq.read_table(path, columns=["turn", "error", "new_tokens"])
            except Exception:  # replaced while we read it: the next poll sees the final file
                continue
            self.seen.add(path)
            first_turns = pc.or_kleene(pc.is_null(table["turn"]), pc.equal(table["turn"], 1))
            self.requests += pc.sum(first_turns.cast("int64")).as_py() or 0
            self.errors += table.num_rows - table["error"].null_count
            self.rows += table.num_rows
            self.tokens += pc.sum(table["new_tokens"]).as_py() or 0

    def _update_bar(self, refresh: bool = True) -> None:
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.n = self.requests
        rate = (self.tokens - self._tokens_before) / elapsed
        self._bar.set_postfix_str(f"{rate:.1f} new tok/s, {self.errors} error rows", refresh=False)
        if refresh:
            self._bar.refresh()

    def _run(self) -> None:
        drawn = time.perf_counter()
        while not self._stop.wait(min(POLL_S if self.gate is None or self.gate.decided else GATE_POLL_S,
                                      self.interval_s)):
            self.poll()
            rows, errors = self.rows - self._rows_before, self.errors - self._errors_before
            if self.gate is not None and self.stopped is None and self.gate.stops(rows, errors):
                self.stopped = (rows, errors)
                self.gate.stop()
            if time.perf_counter() - drawn >= self.interval_s:
                self._update_bar()
                drawn = time.perf_counter()

    def __enter__(self) -> "RunProgress":
        from tqdm import tqdm

        self.poll()
        self._tokens_before, self._rows_before, self._errors_before = self.tokens, self.rows, self.errors
        self._started = time.perf_counter()
        self._bar = tqdm(total=self.total, unit="req", desc="requests x methods", file=sys.stderr,
                         mininterval=0, dynamic_ncols=True)
        self._thread = threading.Thread(target=self._run, name="specbatch-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
        self._update_bar(refresh=False)
        self._bar.close()  # draws the final state once
