"""Report on a specbatch output directory: speed-ups over ar, acceptance, sources, latency, quality, errors.

  python jobs/report.py --output outputs                      # every canned report -> stdout + OUTPUT/report/
  python jobs/report.py --output outputs --run-id RUN         # one run only
  python jobs/report.py --output outputs --sql "SELECT method, avg(speedup) FROM speedups WHERE task = $task
                        GROUP BY method" --param task=summarization

Tables for --sql: generations, runs, speedups (every method joined to ar on the same request and run). Queries are
read-only (one SELECT; no file access) and values are passed with --param NAME=VALUE as $NAME, never pasted in.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis.reports import markdown_table, write_report_files
from analysis.views import QueryLimitError, QueryLimits, ReadOnlyQueryError, check_size, run_query
from specdec_core.cli import OneLineParser  # noqa: E402


def _parameter(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:  # numbers and JSON literals keep their type; anything else is a string
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def build_parser():
    parser = OneLineParser(prog="report.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="outputs", help="the output directory a generation job wrote")
    parser.add_argument("--run-id", default=None, help="report on one run (default: every run)")
    parser.add_argument("--report-dir", default=None, help="where report.md and the PNGs go (default OUTPUT/report)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--sql", default=None, help="one read-only SELECT over generations / runs / speedups")
    parser.add_argument("--param", action="append", type=_parameter, default=[], metavar="NAME=VALUE",
                        help="a query parameter, used as $NAME in --sql (repeatable)")
    parser.add_argument("--sql-timeout-s", type=float, default=60.0, help="--sql is stopped after this long")
    parser.add_argument("--sql-memory-limit", default="2GB", help="most memory --sql may use (DuckDB size: 512MB, 2GB)")
    parser.add_argument("--sql-threads", type=int, default=2, help="threads --sql may use")
    parser.add_argument("--sql-max-rows", type=int, default=1_000_000, help="most rows --sql may return")
    parser.add_argument("--format", choices=["markdown", "json", "csv"], default="markdown",
                        help="how --sql results are printed")
    return parser


def print_query(output: str, sql: str, parameters: dict, fmt: str, limits) -> None:
    import pyarrow.csv as pacsv


    table = run_query(output, sql, parameters, limits)
    if fmt == "json":
        for row in table.to_pylist():
            print(json.dumps(row, default=str))
    elif fmt == "csv":
        pacsv.write_csv(table, sys.stdout.buffer)
    else:
        print(markdown_table(table))


def main(argv: list[str] | None = None) -> int:
    import duckdb


    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.output).is_dir():
        parser.error(f"output directory not found: {args.output}")
    if not (args.sql_timeout_s > 0 and args.sql_threads >= 1 and args.sql_max_rows >= 1):
        parser.error("--sql-timeout-s, --sql-threads and --sql-max-rows must be positive")
    try:
        check_size(args.sql_memory_limit)
    except ValueError as exc:
        parser.error(f"--sql-memory-limit: {exc}")
    limits = QueryLimits(args.sql_timeout_s, args.sql_memory_limit, args.sql_threads, args.sql_max_rows)
    try:
        if args.sql:
            print_query(args.output, args.sql, dict(args.param), args.format, limits)
        else:
            report_dir = Path(args.report_dir) if args.report_dir else Path(args.output) / "report"
            text, written = write_report_files(args.output, args.run_id, report_dir, plots=not args.no_plots)
            print(text)
            print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    except (ReadOnlyQueryError, QueryLimitError, duckdb.Error) as exc:
        print(f"report.py: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
