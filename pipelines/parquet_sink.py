"""Crash-safe output: every finished block of output rows becomes Parquet files under the run's directory as soon as
it is written, each file first written under a hidden temporary name and then renamed (atomic on one filesystem).

A killed job therefore loses only the blocks in flight; readers (pyarrow datasets, DuckDB `**/*.parquet` globs)
never see a half-written file, since the temporary name starts with '.' and does not end in `.parquet`.

File names are a hash of the rows' (request id, method, decode key): a write task that Ray retries, or a decode
batch redone after its actor died, produces the same names and replaces its own files instead of adding copies.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from ray.data import Datasink

TEMPORARY_PREFIX = ".part-"
STOP_FILE = "_STOP"  # in a run's directory: its sink writes the block in hand, then ends the job (request_stop)


class JobStopped(RuntimeError):
    """The run's error gate stopped it (pipelines/progress.py)."""


def request_stop(run_dir: str | Path) -> None:
    """Ask the run's write tasks to end the job: each writes its block in hand, then raises JobStopped, and Ray Data
    stops the dataset (nothing more is read or decoded). A file, so that write tasks on any node see it."""
    (Path(run_dir) / STOP_FILE).touch()


def block_file_name(table: pa.Table) -> str:
    """part-<hash of the block's (request_id, method, decode_key)>.parquet: the same rows always get the same name."""
    keys = sorted(zip(*(table.column(name).to_pylist() for name in ("request_id", "method", "decode_key"))),
                  key=lambda key: tuple("" if part is None else part for part in key))
    digest = hashlib.sha256("\n".join("\t".join(map(str, key)) for key in keys).encode()).hexdigest()[:24]
    return f"part-{digest}.parquet"


def write_atomically(table: pa.Table, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}.parquet.tmp"
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


class RunPartitionSink(Datasink[int]):
    """Writes generation rows to RUN_DIR/method=M/part-*.parquet (hive layout: run_id and method are in the path,
    not in the files)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def write(self, blocks, ctx) -> int:
        written = 0
        for block in blocks:
            table = pa.table(block) if not isinstance(block, pa.Table) else block
            if table.num_rows == 0:
                continue
            for method in pc.unique(table.column("method")).to_pylist():
                part = table.filter(pc.equal(table.column("method"), method)).drop_columns(["run_id", "method"])
                write_atomically(part, Path(self.run_dir) / f"method={method}" / block_file_name(
                    table.filter(pc.equal(table.column("method"), method))))
                written += part.num_rows
            if (Path(self.run_dir) / STOP_FILE).exists():
                raise JobStopped(f"the run's error gate stopped it after {written} rows in this write")
        return written


class KeyedPartSink(Datasink[int]):
    """Writes each block of rows with a unique `key` column to DIR/part-<hash of its keys>.parquet (the refinement
    job's scores: a retried call replaces its own file instead of adding a copy)."""

    def __init__(self, directory: str):
        self.directory = directory

    def write(self, blocks, ctx) -> int:
        written = 0
        for block in blocks:
            table = block if isinstance(block, pa.Table) else pa.table(block)
            if table.num_rows:
                digest = hashlib.sha256("\n".join(sorted(table.column("key").to_pylist())).encode()).hexdigest()[:24]
                write_atomically(table, Path(self.directory) / f"part-{digest}.parquet")
                written += table.num_rows
        return written
