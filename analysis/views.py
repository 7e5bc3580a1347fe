"""DuckDB over an output directory: `generations`, `runs` and `speedups` (every method joined to `ar` on the same
request and run).

`connect(output)` gives live views over the Parquet files. `connect(output, sandbox=True)` copies them into memory
first and then turns off file access and locks the configuration, so ad-hoc SQL can read the tables and nothing
else (no reading other files, no COPY ... TO).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from contract.schema import GENERATIONS_SCHEMA, RUNS_SCHEMA

SPEEDUPS_SQL = """
SELECT m.run_id, m.task, m.request_id, m.method, m.lossy, m.dtype, coalesce(m.deterministic, false) AS deterministic,
       m.tokens_per_s, a.tokens_per_s AS ar_tokens_per_s, m.tokens_per_s / a.tokens_per_s AS speedup,
       a.tpot_s / nullif(m.tpot_s, 0) AS decode_speedup,
       m.new_tokens, m.wall_s, a.new_tokens AS ar_new_tokens, a.wall_s AS ar_wall_s,
       m.mean_accepted_length, m.output_token_ids = a.output_token_ids AS same_output_as_ar
FROM generations m
JOIN generations a ON a.run_id = m.run_id AND a.request_id = m.request_id AND a.method = 'ar'
WHERE m.error IS NULL AND a.error IS NULL AND a.tokens_per_s > 0
"""


def _parquet_source(directory: Path) -> str | None:
    if not directory.exists() or not any(directory.rglob("*.parquet")):
        return None
    pattern = str(directory / "**" / "*.parquet").replace("'", "''")
    # union_by_name: outputs written before a column was added still read, with nulls in it.
    return f"read_parquet('{pattern}', hive_partitioning = true, union_by_name = true)"


def _create(con: duckdb.DuckDBPyConnection, name: str, directory: Path, schema: pa.Schema, kind: str) -> None:
    # The contract's columns always exist: an empty relation when nothing was written yet, and UNION BY NAME fills
    # columns that older outputs lack with NULLs.
    con.register(f"_{name}_contract", schema.empty_table())
    source = _parquet_source(directory)
    body = f"SELECT * FROM _{name}_contract"
    if source is not None:
        body = f"SELECT * FROM {source} UNION ALL BY NAME {body}"
    con.execute(f"CREATE {kind} {name} AS {body}")


def connect(output: str | Path, sandbox: bool = False, limits: "QueryLimits | None" = None
            ) -> duckdb.DuckDBPyConnection:
    output = Path(output)
    con = duckdb.connect()
    kind = "TABLE" if sandbox else "VIEW"
    _create(con, "generations", output / "generations", GENERATIONS_SCHEMA, kind)
    _create(con, "runs", output / "runs", RUNS_SCHEMA, kind)
    con.execute(f"CREATE VIEW speedups AS {SPEEDUPS_SQL}")
    if limits is not None:  # set after the copy: the limits are the query's, the tables are already in memory
        con.execute(f"SET memory_limit = '{check_size(limits.memory_limit)}'")
        con.execute(f"SET threads = {int(limits.threads)}")
        con.execute("SET temp_directory = ''")  # no spilling: nothing written, and memory_limit is a hard cap
    if sandbox:
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    return con


def check_size(text: str) -> str:
    """A DuckDB size ("2GB", "512MB") or ValueError: it goes into a SET statement."""
    if not re.fullmatch(r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", text.strip()):
        raise ValueError(f"a size such as 512MB or 2GB is expected, got {text!r}")
    return text.strip()


class ReadOnlyQueryError(ValueError):
    pass


def check_read_only(sql: str) -> None:
    """Ad-hoc SQL must be exactly one SELECT (WITH ... SELECT included); anything else is refused before it runs."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise ReadOnlyQueryError(f"cannot parse the query: {exc}") from None
    if len(statements) != 1:
        raise ReadOnlyQueryError(f"give exactly one statement, got {len(statements)}")
    if statements[0].type != duckdb.StatementType.SELECT:
        raise ReadOnlyQueryError(f"only SELECT queries are allowed, got {statements[0].type.name}")


class QueryLimitError(RuntimeError):
    pass


@dataclass(frozen=True)
class QueryLimits:
    """What one ad-hoc query may use: a cross join must not take the machine down. DuckDB never spills to disk
    here (the temporary directory is off), so memory_limit is a hard cap."""

    timeout_s: float = 60.0
    memory_limit: str = "2GB"
    threads: int = 2
    max_rows: int = 1_000_000  # rows of the result (it is held in memory, then printed)


def run_query(output: str | Path, sql: str, parameters: dict | None = None,
              limits: QueryLimits = QueryLimits()) -> pa.Table:
    """One read-only query over the sandboxed tables; values come in as named parameters ($name), never as text."""
    check_read_only(sql)
    con = connect(output, sandbox=True, limits=limits)
    stopped = threading.Event()

    def stop() -> None:
        stopped.set()
        con.interrupt()

    timer = threading.Timer(limits.timeout_s, stop)
    timer.start()
    try:
        reader = con.sql(sql, params=parameters or {}).to_arrow_reader(65536)
        batches, rows = [], 0
        for batch in reader:
            rows += batch.num_rows
            if rows > limits.max_rows:
                raise QueryLimitError(f"the result has more than {limits.max_rows} rows: add a LIMIT or aggregate")
            batches.append(batch)
        return pa.Table.from_batches(batches, schema=reader.schema)
    except (duckdb.Error, pa.ArrowException, OSError) as exc:
        # Raised by DuckDB, or through the Arrow stream when the query fails while its result is being read.
        if stopped.is_set():
            raise QueryLimitError(f"the query was stopped after {limits.timeout_s:g} s (--sql-timeout-s)") from None
        if isinstance(exc, duckdb.OutOfMemoryException) or "Out of Memory" in str(exc):
            raise QueryLimitError(f"the query needs more than {limits.memory_limit} of memory "
                                  "(--sql-memory-limit)") from None
        raise
    finally:
        timer.cancel()
        con.close()
