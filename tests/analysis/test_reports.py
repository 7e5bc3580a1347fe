"""Views, canned reports, read-only ad-hoc SQL and plots on a small hand-made output directory with known answers."""

import json
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from analysis.reports import REPORTS, build_report, run_report
from analysis.views import ReadOnlyQueryError, check_read_only, connect, run_query
from pipelines.outputs import write_run_row
from contract.schema import generations_table
from tests.job_runs import run_job

NOW = datetime(2026, 11, 22, tzinfo=timezone.utc)


def row(run, request, method, new, wall, forwards=None, ids=(1, 2, 3), **extra):
    return {"run_id": run, "job": "summarize", "request_id": request, "method": method, "task": "summarization",
            "new_tokens": new, "wall_s": wall, "tokens_per_s": new / wall, "target_forwards": forwards or new,
            "output_token_ids": list(ids), "ttft_s": 0.1, "tpot_s": (wall - 0.1) / (new - 1), "lossy": False,
            "dtype": "bfloat16", "started_at": NOW, "mean_accepted_length": new / (forwards or new),
            "accepted_by_source": extra.pop("sources", {"target": new}), **extra}


ROWS = [
    # run r1: copyspec is 2x then 4x ar's tokens/s -> mean of ratios 3, ratio of totals (150/7.5)/(150/20) = 8/3.
    row("r1", "q1", "ar", 100, 10.0, quality_metric="rouge_l", quality=0.2),
    row("r1", "q2", "ar", 50, 10.0),
    row("r1", "q3", "ar", 10, 1.0),
    row("r1", "q1", "copyspec", 100, 5.0, forwards=40, drafted_tokens=80, accepted_tokens=60, copied_tokens=60,
        sources={"copy": 60, "target": 40}, quality_metric="rouge_l", quality=0.5),
    row("r1", "q2", "copyspec", 50, 2.5, forwards=20, ids=(9,), drafted_tokens=40, accepted_tokens=30,
        copied_tokens=30, sources={"copy": 30, "target": 20}, quality_metric="rouge_l", quality=0.3),
    {"run_id": "r1", "request_id": "q3", "method": "copyspec", "task": "summarization", "error": "boom"},
    # run r2: ar alone, much faster; it must never be paired with r1's copyspec rows.
    row("r2", "q1", "ar", 100, 1.0),
]


def write_output(out: Path, rows=ROWS) -> Path:
    for (run, method) in sorted({(r["run_id"], r["method"]) for r in rows}):
        part = generations_table([r for r in rows if (r["run_id"], r["method"]) == (run, method)])
        part = part.drop_columns(["run_id", "method"])
        target = out / "generations" / f"run_id={run}" / f"method={method}"
        target.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, target / "part-0.parquet")
    for run in ("r1", "r2"):
        write_run_row(out, {"run_id": run, "job": "summarize", "config": {}, "versions": {}, "hardware": {},
                            "started_at": NOW, "ended_at": NOW, "rows_in": 3, "rows_out": 6, "errors": 1})
    return out


@pytest.fixture()
def output(tmp_path):
    return write_output(tmp_path / "out")


def by_method(table):
    return {r["method"]: r for r in table.to_pylist()}


def test_speedups_pair_each_method_with_ar_in_the_same_run(output):
    con = connect(output)
    rows = con.sql("SELECT run_id, request_id, speedup, same_output_as_ar FROM speedups WHERE method = 'copyspec' "
                   "ORDER BY request_id").fetchall()
    assert rows == [("r1", "q1", 2.0, True), ("r1", "q2", 4.0, False)]  # q3 failed: no pair
    report = by_method(run_report(con, "speedup"))
    assert report["copyspec"]["mean_of_ratios"] == pytest.approx(3.0)
    assert report["copyspec"]["ratio_of_totals"] == pytest.approx(8 / 3)
    assert report["copyspec"]["pct_same_output_as_ar"] == pytest.approx(50.0)
    assert report["ar"]["requests"] == 4 and report["ar"]["mean_of_ratios"] == 1.0


def test_acceptance_sources_quality_errors_and_run_filter(output):
    con = connect(output)
    acceptance = by_method(run_report(con, "acceptance", "r1"))["copyspec"]
    assert acceptance["mean_accepted_length"] == pytest.approx(150 / 60)
    assert acceptance["acceptance_rate"] == pytest.approx(90 / 120)
    assert acceptance["pct_copied"] == pytest.approx(60.0)
    sources = {(r["method"], r["source"]): r for r in run_report(con, "sources").to_pylist()}
    assert sources[("copyspec", "copy")]["tokens"] == 90 and sources[("copyspec", "copy")]["pct_of_method"] == 60
    quality = by_method(run_report(con, "quality"))
    assert quality["copyspec"]["mean_quality"] == pytest.approx(0.4) and quality["copyspec"]["scored"] == 2
    errors = by_method(run_report(con, "errors"))
    assert errors["copyspec"]["errors"] == 1 and errors["copyspec"]["example_error"] == "boom"
    assert errors["ar"]["errors"] == 0
    assert by_method(run_report(con, "acceptance", "r2"))["ar"]["requests"] == 1
    latency = by_method(run_report(con, "latency", "r1"))
    assert latency["ar"]["ttft_p50"] == pytest.approx(0.1)


def test_outputs_without_the_newer_columns_still_read(tmp_path):
    out = write_output(tmp_path / "old", [row("r0", "q1", "ar", 10, 1.0)])
    for path in (out / "generations").rglob("*.parquet"):
        pq.write_table(pq.read_table(path).drop_columns(["quality", "quality_metric", "diff"]), path)
    con = connect(out)
    assert con.sql("SELECT count(*), count(quality) FROM generations").fetchall() == [(1, 0)]


def test_an_empty_output_directory_gives_empty_reports(tmp_path):
    text, tables = build_report(tmp_path)
    assert set(tables) == set(REPORTS) and all(t.num_rows == 0 for t in tables.values())
    assert "(no rows)" in text


@pytest.mark.parametrize("sql, fragment", [
    ("DROP TABLE generations", "only SELECT"),
    ("COPY generations TO '/tmp/leak.csv'", "only SELECT"),
    ("SELECT 1; SELECT 2", "exactly one statement"),
    ("SELEC nonsense", "cannot parse"),
])
def test_ad_hoc_sql_refuses_anything_but_one_select(sql, fragment):
    with pytest.raises(ReadOnlyQueryError, match=fragment):
        check_read_only(sql)


def test_ad_hoc_sql_cannot_read_other_files_and_takes_parameters(output):
    with pytest.raises(Exception, match="disabled by configuration"):
        run_query(output, "SELECT * FROM read_text('/etc/hostname')")
    table = run_query(output, "SELECT count(*) AS n FROM generations WHERE method = $m AND run_id = $r",
                      {"m": "ar", "r": "r1"})
    assert table.to_pylist() == [{"n": 3}]
    # A value that looks like SQL stays a value.
    assert run_query(output, "SELECT count(*) AS n FROM runs WHERE job = $j",
                     {"j": "x' OR '1'='1"}).to_pylist() == [{"n": 0}]


def report_cli(*args):
    """jobs/report.py's main in this process: (returncode, stdout, stderr) as the process would give them."""
    return run_job("report.py", *args)


def test_report_job_writes_markdown_and_plots_and_runs_queries(output):
    proc = report_cli("--output", str(output), "--run-id", "r1")
    assert proc.returncode == 0, proc.stderr
    report = (output / "report" / "report.md").read_text()
    # The same-output share is read with its dtype and mode (only --deterministic guarantees it in bf16).
    # decode: ar's time per output token ÷ the method's, (9.9 / 99) / (4.9 / 99) and (9.9 / 49) / (2.4 / 49)
    assert "| summarization | copyspec | bfloat16 | no | no | 2 | 3.000 | 2.667 | 3.073 | 50.0 |" in report
    for png in ("speedup.png", "accepted_length.png"):
        assert (output / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = report_cli("--output", str(output), "--sql", "SELECT request_id FROM speedups WHERE speedup > $x "
                      "ORDER BY 1", "--param", "x=3", "--format", "json")
    assert proc.returncode == 0 and [json.loads(l) for l in proc.stdout.splitlines()] == [{"request_id": "q2"}]
    for bad in (["--sql", "DELETE FROM runs"], ["--param", "no-equals-sign"], ["--output", str(output / "nope")]):
        proc = report_cli("--output", str(output), *bad) if bad[0] != "--output" else report_cli(*bad)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_ad_hoc_sql_stops_at_its_time_memory_and_row_limits(output):
    """A cross join cannot take the machine down: each limit stops it with one clear line and exit status 2."""
    from analysis.views import QueryLimitError, QueryLimits

    cross = "SELECT count(*) FROM range(100000000) a CROSS JOIN range(100000000) b CROSS JOIN generations"
    with pytest.raises(QueryLimitError, match="stopped after 1 s"):
        run_query(output, cross, limits=QueryLimits(timeout_s=1, threads=1))
    with pytest.raises(QueryLimitError, match="more than 64MB of memory"):
        run_query(output, "SELECT a.range x, b.range y FROM range(20000) a, range(20000) b ORDER BY x DESC, y",
                  limits=QueryLimits(memory_limit="64MB", threads=1, max_rows=10**12))
    with pytest.raises(QueryLimitError, match="more than 10 rows"):
        run_query(output, "SELECT * FROM range(11)", limits=QueryLimits(max_rows=10))
    assert run_query(output, "SELECT * FROM range(10)", limits=QueryLimits(max_rows=10)).num_rows == 10
    proc = report_cli("--output", str(output), "--sql", cross, "--sql-timeout-s", "1", "--sql-threads", "1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "report.py: error: the query was stopped after 1 s (--sql-timeout-s)"], proc.stderr
