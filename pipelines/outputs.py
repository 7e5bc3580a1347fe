"""Output directory handling: staging then publish (no partial file ever looks finished), runs rows, resume state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from contract.schema import GENERATIONS_SCHEMA, RUNS_SCHEMA


def generations_dir(output: str | Path) -> Path:
    return Path(output) / "generations"


def runs_dir(output: str | Path) -> Path:
    return Path(output) / "runs"


def staging_dir(output: str | Path, run_id: str) -> Path:
    return Path(output) / "_staging" / run_id


def read_generations(output: str | Path) -> pa.Table:
    """Every published generation row (empty table with the contract's schema when there are none)."""
    path = generations_dir(output)
    if not path.exists() or not any(path.rglob("*.parquet")):
        return GENERATIONS_SCHEMA.empty_table()
    dataset = pads.dataset(str(path), format="parquet", partitioning="hive",
                           schema=GENERATIONS_SCHEMA)
    return dataset.to_table()


def done_pairs(output: str | Path) -> frozenset[str]:
    """'request_id<TAB>method' of rows already published without error (what --resume skips)."""
    table = read_generations(output).select(["request_id", "method", "error"]).to_pylist()
    return frozenset(f"{r['request_id']}\t{r['method']}" for r in table if r["error"] is None)


def publish(output: str | Path, run_id: str) -> int:
    """Move a finished run's Parquet files from staging into generations/ (renames: atomic per file)."""
    stage = staging_dir(output, run_id)
    moved = 0
    for source in sorted(stage.rglob("*.parquet")):
        relative = source.relative_to(stage)
        target = generations_dir(output) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        moved += 1
    shutil.rmtree(stage, ignore_errors=True)
    return moved


def count_rows(output: str | Path, run_id: str) -> tuple[int, int]:
    """(rows, error rows) published for one run."""
    path = generations_dir(output) / f"run_id={run_id}"
    if not path.exists():
        return 0, 0
    table = pads.dataset(str(path), format="parquet").to_table(columns=["error"])
    errors = table.column("error").null_count
    return table.num_rows, table.num_rows - errors


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
                 "pass_mean_occupancy", "pass_peak_kv_bytes", "actor_id"]).to_pylist()
    stats: dict[str, dict] = {}
    for row in rows:
        entry = stats.setdefault(row["method"], {"method": row["method"], "requests": 0, "errors": 0, "new_tokens": 0,
                                                 "drafted_tokens": 0, "accepted_tokens": 0, "passes": {},
                                                 "actor_ids": set()})
        entry["requests"] += 1
        if row["error"] is not None:
            entry["errors"] += 1
        else:
            entry["new_tokens"] += row["new_tokens"] or 0
            entry["drafted_tokens"] += row["drafted_tokens"] or 0
            entry["accepted_tokens"] += row["accepted_tokens"] or 0
        if row["decode_pass"] is not None:
            entry["passes"][row["decode_pass"]] = (row["pass_wall_s"], row["pass_mean_occupancy"],
                                                   row["pass_peak_kv_bytes"])
            entry["actor_ids"].add(row["actor_id"])
    out = []
    for entry in sorted(stats.values(), key=lambda e: e["method"]):
        passes = [p for p in entry.pop("passes").values() if p[0] is not None]
        actors = max(1, len(entry.pop("actor_ids")))
        total = sum(p[0] for p in passes)
        wall = total / actors if passes else None
        occupancy = sum(p[0] * (p[1] or 0) for p in passes) / total if total else None  # time-weighted
        out.append({**entry, "decode_wall_s": wall, "actors": actors,
                    "job_tokens_per_s": entry["new_tokens"] / wall if wall else None, "mean_occupancy": occupancy,
                    "peak_kv_bytes": max((p[2] or 0 for p in passes), default=None)})
    return out
