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


def _parameter(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:  # numbers and JSON literals keep their type; anything else is a string
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def build_parser():
    from specdec_core.cli import OneLineParser

    parser = OneLineParser(prog="report.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="outputs", help="the output directory a generation job wrote")
    parser.add_argument("--run-id", default=None, help="report on one run (default: every run)")
    parser.add_argument("--report-dir", default=None, help="where report.md and the PNGs go (default OUTPUT/report)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--sql", default=None, help="one read-only SELECT over generations / runs / speedups")
    parser.add_argument("--param", action="append", type=_parameter, default=[], metavar="NAME=VALUE",
                        help="a query parameter, used as $NAME in --sql (repeatable)")
    parser.add_argument("--format", choices=["markdown", "json", "csv"], default="markdown",
                        help="how --sql results are printed")
    return parser


def print_query(output: str, sql: str, parameters: dict, fmt: str) -> None:
    import pyarrow.csv as pacsv

    from analysis.reports import markdown_table
    from analysis.views import run_query

    table = run_query(output, sql, parameters)
    if fmt == "json":
        for row in table.to_pylist():
            print(json.dumps(row, default=str))
    elif fmt == "csv":
        pacsv.write_csv(table, sys.stdout.buffer)
    else:
        print(markdown_table(table))


def write_report(output: str, run_id: str | None, report_dir: Path, plots: bool) -> list[Path]:
    from analysis.plots import accepted_length_histogram, speedup_bars
    from analysis.reports import build_report
    from analysis.views import run_query

    text, tables = build_report(output, run_id)
    report_dir.mkdir(parents=True, exist_ok=True)
    written = [report_dir / "report.md"]
    written[0].write_text(text, encoding="utf-8")
    if plots:
        lengths = run_query(output, "SELECT method, list(mean_accepted_length) AS v FROM generations WHERE error IS "
                                    "NULL AND ($run_id::VARCHAR IS NULL OR run_id = $run_id) GROUP BY method",
                            {"run_id": run_id}).to_pylist()
        for path in (speedup_bars(tables["speedup"], report_dir / "speedup.png"),
                     accepted_length_histogram({r["method"]: r["v"] for r in lengths},
                                               report_dir / "accepted_length.png")):
            if path is not None:
                written.append(path)
    print(text)
    return written


def main(argv: list[str] | None = None) -> int:
    import duckdb

    from analysis.views import ReadOnlyQueryError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.output).is_dir():
        parser.error(f"output directory not found: {args.output}")
    try:
        if args.sql:
            print_query(args.output, args.sql, dict(args.param), args.format)
        else:
            report_dir = Path(args.report_dir) if args.report_dir else Path(args.output) / "report"
            written = write_report(args.output, args.run_id, report_dir, not args.no_plots)
            print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    except (ReadOnlyQueryError, duckdb.Error) as exc:
        print(f"report.py: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
