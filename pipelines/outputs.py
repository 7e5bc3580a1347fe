"""Output directory handling: a run's directory (blocks appear as they finish, `_SUCCESS` when the run ends), the
run lock, resume state and runs rows. Nothing here touches a path outside the output directory: run ids are checked
(`GenerationConfig`) before any of these run."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from contract.schema import GENERATIONS_SCHEMA, RUNS_SCHEMA


def generations_dir(output: str | Path) -> Path:
    return Path(output) / "generations"


def runs_dir(output: str | Path) -> Path:
    return Path(output) / "runs"


def run_dir(output: str | Path, run_id: str) -> Path:
    return generations_dir(output) / f"run_id={run_id}"


SUCCESS_MARKER = "_SUCCESS"


def mark_finished(output: str | Path, run_id: str) -> None:
    (run_dir(output, run_id) / SUCCESS_MARKER).write_text("")


def latest_unfinished_run(output: str | Path) -> str | None:
    """The run id of the most recently written run directory without `_SUCCESS` (what a bare --resume continues)."""
    root = generations_dir(output)
    if not root.exists():
        return None
    runs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("run_id=")
            and not (d / SUCCESS_MARKER).exists()]
    return max(runs, key=lambda d: d.stat().st_mtime).name.removeprefix("run_id=") if runs else None


def clean_temporary_files(output: str | Path, run_id: str) -> int:
    """Remove the half-written block files a killed run left in its directory (hidden `.part-*.tmp` names)."""
    from .parquet_sink import TEMPORARY_PREFIX  # lazy: ray (parquet_sink), kept out of a job's argument check

    removed = 0
    for stale in run_dir(output, run_id).rglob(f"{TEMPORARY_PREFIX}*.tmp"):
        stale.unlink(missing_ok=True)
        removed += 1
    return removed


class RunLockedError(RuntimeError):
    pass


class RunLock:
    """OUTPUT/_locks/RUN_ID.lock, created exclusively: a second job writing the same run id at the same time is
    refused. A lock left by a process that no longer runs on this host is taken over."""

    def __init__(self, output: str | Path, run_id: str):
        self.path = Path(output) / "_locks" / f"{run_id}.lock"
        self.run_id = run_id
        self.held = False

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if not self._stale():
                    raise RunLockedError(f"run {self.run_id!r} is being written by another job ({self._owner()}); "
                                         f"if that job is dead on another host, remove {self.path}")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(owner)
            self.held = True
            return self
        raise RunLockedError(f"could not take the lock {self.path}")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def _owner(self) -> str:
        try:
            return self.path.read_text()
        except OSError:
            return "unknown owner"

    def _stale(self) -> bool:
        try:
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False  # being written right now, or not ours to judge: not stale
        if owner.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(owner["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def done_pairs(output: str | Path, run_id: str, decode_keys: dict[str, str]) -> frozenset[str]:
    """'request_id<TAB>method' of the run's rows (error rows too: each pair is written once) decoded with the same
    decode key as now (model, dtype, sampling, decoding parameters, prompt options): what --resume skips. A pair
    decoded with another key (say another --max-new-tokens) is not done."""
    path = run_dir(output, run_id)
    if not path.exists() or not any(path.rglob("*.parquet")):
        return frozenset()
    table = pads.dataset(str(path), format="parquet", partitioning="hive", schema=GENERATIONS_SCHEMA).to_table(
        columns=["request_id", "method", "decode_key"]).to_pylist()
    return frozenset(f"{r['request_id']}\t{r['method']}" for r in table
                     if r["decode_key"] is not None and decode_keys.get(r["method"]) == r["decode_key"])


def drop_duplicate_pairs(output: str | Path, run_id: str) -> int:
    """Keep one row per (request, method, decode key) in a run; returns how many copies were removed.

    Why: a run whose driver was killed can leave a worker that still publishes its block a moment later, after a
    --resume listed what was done and decoded those pairs again (seen once in the driver-kill test). Both copies hold
    the same decode; the one in the file that sorts first is kept, and the other files are rewritten without theirs
    (atomically; a file left empty is removed). Rows of another decode key are another decode and stay."""
    from .parquet_sink import write_atomically  # lazy: ray (parquet_sink), kept out of a job's argument check

    seen: set[tuple] = set()
    removed = 0
    for file in sorted(run_dir(output, run_id).glob("method=*/*.parquet")):
        table = pq.read_table(file)
        pairs = zip(table.column("request_id").to_pylist(), table.column("decode_key").to_pylist())
        keep = []
        for pair in pairs:
            key = (file.parent.name, *pair)
            keep.append(key not in seen)
            seen.add(key)
        if all(keep):
            continue
        removed += keep.count(False)
        kept = table.filter(pa.array(keep))
        if kept.num_rows:
            write_atomically(kept, file)
        else:
            file.unlink()
    return removed


def count_rows(output: str | Path, run_id: str) -> tuple[int, int]:
    """(rows, error rows) published for one run."""
    path = generations_dir(output) / f"run_id={run_id}"
    if not path.exists():
        return 0, 0
    table = pads.dataset(str(path), format="parquet").to_table(columns=["error"])
    errors = table.column("error").null_count
    return table.num_rows, table.num_rows - errors


def common_errors(output: str | Path, run_id: str, top: int = 5) -> list[tuple[str, int]]:
    """The run's most frequent error messages, numbers folded to N so that "prompt has 9000 tokens" and "prompt has
    9100 tokens" count as one kind: [(message, rows)], most frequent first."""
    import re
    from collections import Counter

    path = run_dir(output, run_id)
    if not path.exists():
        return []
    errors = pads.dataset(str(path), format="parquet").to_table(columns=["error"]).column("error").drop_null()
    kinds = Counter(re.sub(r"\d+(\.\d+)?", "N", message)[:200] for message in errors.to_pylist())
    return kinds.most_common(top)


def write_run_row(output: str | Path, row: dict) -> Path:
    target_dir = runs_dir(output) / f"run_id={row['run_id']}"
    target_dir.mkdir(parents=True, exist_ok=True)
    row = {**row, **{k: json.dumps(row[k], default=str) for k in ("config", "versions", "hardware")}}
    table = pa.Table.from_pylist([row], schema=RUNS_SCHEMA).drop_columns(["run_id"])
    temporary = target_dir / "run.parquet.tmp"
    pq.write_table(table, temporary)
    final = target_dir / "run.parquet"
    temporary.rename(final)
    return final


def method_summary(output: str | Path, run_id: str) -> list[dict]:
    """Per method of one run: requests, errors, tokens/s over all rows, mean accepted length (for the job's print)."""
    path = generations_dir(output) / f"run_id={run_id}"
    if not path.exists():
        return []
    rows = pads.dataset(str(path), format="parquet", partitioning="hive").to_table(
        columns=["method", "new_tokens", "wall_s", "target_forwards", "error"]).to_pylist()
    summary = {}
    for row in rows:
        entry = summary.setdefault(row["method"], {"method": row["method"], "rows": 0, "errors": 0, "new_tokens": 0,
                                                   "wall_s": 0.0, "target_forwards": 0})
        entry["rows"] += 1
        if row["error"] is not None:
            entry["errors"] += 1
            continue
        entry["new_tokens"] += row["new_tokens"]
        entry["wall_s"] += row["wall_s"]
        entry["target_forwards"] += row["target_forwards"]
    for entry in summary.values():
        entry["tokens_per_s"] = entry["new_tokens"] / entry["wall_s"] if entry["wall_s"] else None
        forwards = entry["target_forwards"]
        entry["mean_accepted_length"] = entry["new_tokens"] / forwards if forwards else None
    return sorted(summary.values(), key=lambda e: e["method"])


def longest_warmup(output: str | Path, run_id: str) -> float | None:
    """The run's longest decode actor warm-up (actor_warmup_s), or None."""
    path = generations_dir(output) / f"run_id={run_id}"
    if not path.exists():
        return None
    column = pads.dataset(str(path), format="parquet", partitioning="hive", schema=GENERATIONS_SCHEMA).to_table(
        columns=["actor_warmup_s"]).column(0)
    return pc.max(column).as_py()


def kernel_plans(output: str | Path, run_id: str) -> dict:
    """The run's kernel plans (each actor's, kernel_plan.py) and the longest time an actor spent timing its plan."""
    path = generations_dir(output) / f"run_id={run_id}"
    if not path.exists():
        return {"kernel_plans": [], "kernel_plan_s": None}
    table = pads.dataset(str(path), format="parquet", partitioning="hive", schema=GENERATIONS_SCHEMA).to_table(
        columns=["kernel_plan", "kernel_plan_s"])
    return {"kernel_plans": sorted(set(table.column("kernel_plan").drop_null().to_pylist())),
            "kernel_plan_s": pc.max(table.column("kernel_plan_s")).as_py()}


def method_stats(output: str | Path, run_id: str) -> list[dict]:
    """Per method of one run, the runs row's `method_stats`: job throughput from the decoder passes' wall times.

    A pass is one method over one actor call's rows; passes of one actor run one after another, passes of different
    actors at the same time, so the method's decode wall time is the passes' total divided by the actors that ran
    them (exact for one actor).
    """
    path = generations_dir(output) / f"run_id={run_id}"
    if not path.exists():
        return []
    rows = pads.dataset(str(path), format="parquet", partitioning="hive", schema=GENERATIONS_SCHEMA).to_table(
        columns=["method", "new_tokens", "drafted_tokens", "accepted_tokens", "error", "decode_pass", "pass_wall_s",
                 "pass_prefill_s", "pass_mean_occupancy", "pass_peak_kv_bytes", "pass_prompt_tokens", "pass_prefix_hit_tokens",
                 "pass_memory_tokens", "accepted_by_source", "actor_id", "pass_capture_s"]).to_pylist()
    stats: dict[str, dict] = {}
    for row in rows:
        entry = stats.setdefault(row["method"], {"method": row["method"], "requests": 0, "errors": 0, "new_tokens": 0,
                                                 "drafted_tokens": 0, "accepted_tokens": 0, "passes": {},
                                                 "actor_ids": set(), "memory_accepted": 0})
        entry["requests"] += 1
        if row["error"] is not None:
            entry["errors"] += 1
        else:
            entry["new_tokens"] += row["new_tokens"] or 0
            entry["drafted_tokens"] += row["drafted_tokens"] or 0
            entry["accepted_tokens"] += row["accepted_tokens"] or 0
            entry["memory_accepted"] += dict(row["accepted_by_source"] or ()).get("memory", 0)
        if row["decode_pass"] is not None:
            entry["passes"][row["decode_pass"]] = (row["pass_wall_s"], row["pass_mean_occupancy"],
                                                   row["pass_peak_kv_bytes"], row["pass_prompt_tokens"],
                                                   row["pass_prefix_hit_tokens"], row["pass_memory_tokens"],
                                                   row["pass_prefill_s"], row["pass_capture_s"])
            entry["actor_ids"].add(row["actor_id"])
    out = []
    for entry in sorted(stats.values(), key=lambda e: e["method"]):
        passes = [p for p in entry.pop("passes").values() if p[0] is not None]
        actors = max(1, len(entry.pop("actor_ids")))
        total = sum(p[0] for p in passes)
        wall = total / actors if passes else None
        occupancy = sum(p[0] * (p[1] or 0) for p in passes) / total if total else None  # time-weighted
        prompt_tokens = sum(p[3] or 0 for p in passes)
        memory_accepted = entry.pop("memory_accepted")
        memory_sizes = [p[5] for p in passes if p[5] is not None]
        # apart only where every pass was (a run resumed from outputs written before: none)
        split = bool(passes) and all(p[6] is not None for p in passes)
        prefill = sum(p[6] for p in passes) / actors if split else None
        decode = sum(p[0] - p[6] - (p[7] or 0.0) for p in passes) / actors if split else None  # captures apart
        prefilled = sum((p[3] or 0) - (p[4] or 0) for p in passes)
        out.append({**entry, "decode_wall_s": wall, "actors": actors,
                    "job_tokens_per_s": entry["new_tokens"] / wall if wall else None,
                    "prefill_s": prefill, "decode_s": decode,
                    "prefill_tokens_per_s": prefilled / prefill if prefill else None,
                    "decode_tokens_per_s": entry["new_tokens"] / decode if decode else None,
                    "mean_occupancy": occupancy,
                    "peak_kv_bytes": max((p[2] or 0 for p in passes), default=None),
                    "prefix_hit_rate": sum(p[4] or 0 for p in passes) / prompt_tokens if prompt_tokens else None,
                    "memory_tokens": max(memory_sizes) if memory_sizes else None,
                    "memory_accepted_share": (memory_accepted / entry["accepted_tokens"]
                                              if memory_sizes and entry["accepted_tokens"] else None),
                    "capture_s": sum(p[7] or 0.0 for p in passes) / actors if passes else None})
    return out
