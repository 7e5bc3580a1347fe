"""The canned reports: named SQL queries over the analysis views, and their rendering as Markdown tables.

Every query takes one parameter, $run_id (NULL = all runs). Speed-ups compare a method with `ar` on the same
request in the same run only (the `speedups` view), reported both as the mean of per-request ratios and as the
ratio of totals (tokens/s over all requests), as DESIGN.md defines them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from .plots import accepted_length_histogram, speedup_bars
from .views import connect

RUN_FILTER = "($run_id::VARCHAR IS NULL OR run_id = $run_id)"


@dataclass(frozen=True)
class Report:
    title: str
    sql: str
    note: str = ""


REPORTS: dict[str, Report] = {
    "throughput": Report("Job throughput by method (batched decoding)", f"""
        WITH m AS (SELECT run_id, unnest(method_stats, recursive := true) FROM runs WHERE {RUN_FILTER}),
             ar AS (SELECT run_id, job_tokens_per_s AS ar_tokens_per_s, decode_tokens_per_s AS ar_decode_tokens_per_s
                    FROM m WHERE method = 'ar')
        SELECT m.run_id, method, requests, errors, new_tokens, decode_wall_s, job_tokens_per_s,
               job_tokens_per_s / ar.ar_tokens_per_s AS x_ar, prefill_s, decode_s,
               100 * prefill_s / nullif(decode_wall_s, 0) AS pct_prefill, prefill_tokens_per_s, decode_tokens_per_s,
               decode_tokens_per_s / ar.ar_decode_tokens_per_s AS decode_x_ar, mean_occupancy,
               accepted_tokens / nullif(drafted_tokens, 0) AS acceptance_rate, drafted_tokens, accepted_tokens,
               peak_kv_bytes / 1048576.0 AS peak_kv_mib, 100 * prefix_hit_rate AS pct_prefix_hit,
               memory_tokens, 100 * memory_accepted_share AS pct_accepted_from_memory, capture_s
        FROM m LEFT JOIN ar USING (run_id) ORDER BY m.run_id, method""",
        "job tokens/s = the method's new tokens ÷ its decode wall time (its batched passes; model load and each "
        "actor's warm-up excluded); x ar = that ÷ ar's in the same run. The wall time splits into prefill (the target's "
        "prompt forwards, which no speculation shortens; prefill tokens/s counts prompt tokens the prefix cache did not "
        "supply) and decode (the rest): decode tokens/s = new tokens ÷ decode s, decode x ar = that ÷ ar's. Each "
        "method is measured as if it ran alone: its own prefix cache, step costs, acceptance and job memory; occupancy = mean live rows per decode step; prefix hit = prompt tokens "
        "the prefix cache supplied; memory = the job memory's output tokens (suffix, auto) and the share of accepted "
        "draft tokens drafted from it; capture s = a GPU's graph captures of its steps: in the wall time, not in decode s."),
    "runs": Report("Runs", f"""
        SELECT run_id, job, started_at, ended_at, rows_in, rows_out, errors
        FROM runs WHERE {RUN_FILTER} ORDER BY started_at"""),
    "speedup": Report("Speed-up over ar by method and task", f"""
        SELECT coalesce(task, '-') AS task, method, dtype, deterministic, bool_or(lossy) AS lossy,
               count(*) AS requests,
               avg(speedup) AS mean_of_ratios,
               (sum(new_tokens) / sum(wall_s)) / (sum(ar_new_tokens) / sum(ar_wall_s)) AS ratio_of_totals,
               avg(decode_speedup) AS decode_mean_of_ratios,
               100 * avg(same_output_as_ar::INT) AS pct_same_output_as_ar
        FROM speedups WHERE {RUN_FILTER} GROUP BY ALL ORDER BY task, method""",
        "tokens/s of the method ÷ tokens/s of ar on the same request in the same run (prefill included); decode = "
        "the same for the tokens after the first (ar's time per output token ÷ the method's). Same output as ar: "
        "guaranteed for lossless methods in fp32, and in bf16 with --deterministic (the dtype and mode columns)."),
    "acceptance": Report("Acceptance by method and task", f"""
        SELECT coalesce(task, '-') AS task, method, count(*) AS requests, sum(new_tokens) AS new_tokens,
               sum(new_tokens) / sum(wall_s) AS tokens_per_s,
               sum(new_tokens) / sum(target_forwards) AS mean_accepted_length,
               sum(accepted_tokens) / nullif(sum(drafted_tokens), 0) AS acceptance_rate,
               100 * sum(copied_tokens) / nullif(sum(new_tokens), 0) AS pct_copied
        FROM generations WHERE error IS NULL AND {RUN_FILTER} GROUP BY ALL ORDER BY task, method""",
        "mean accepted length = new tokens / target forwards (bonus token included, ar = 1.0); "
        "acceptance rate = accepted / drafted tokens."),
    "sources": Report("Accepted tokens by source", f"""
        WITH kept AS (
            SELECT coalesce(task, '-') AS task, method, unnest(map_keys(accepted_by_source)) AS source,
                   unnest(map_values(accepted_by_source)) AS tokens
            FROM generations WHERE error IS NULL AND {RUN_FILTER})
        SELECT task, method, source, sum(tokens) AS tokens,
               100 * sum(tokens) / sum(sum(tokens)) OVER (PARTITION BY task, method) AS pct_of_method
        FROM kept GROUP BY task, method, source ORDER BY task, method, tokens DESC""",
        "`target` = tokens the target model emitted itself (bonus or correction tokens); `context` = tokens copied "
        "from the row's separate context document (RAG passages) rather than from its prompt or output; `copy` / "
        "`lookup` = copied from the prompt or the output so far."),
    "latency": Report("Latency percentiles (TTFT in s, TPOT in ms)", f"""
        SELECT method, count(*) AS requests,
               quantile_cont(ttft_s, 0.5) AS ttft_p50, quantile_cont(ttft_s, 0.9) AS ttft_p90,
               quantile_cont(ttft_s, 0.99) AS ttft_p99,
               1000 * quantile_cont(tpot_s, 0.5) AS tpot_p50_ms, 1000 * quantile_cont(tpot_s, 0.9) AS tpot_p90_ms,
               1000 * quantile_cont(tpot_s, 0.99) AS tpot_p99_ms
        FROM generations WHERE error IS NULL AND {RUN_FILTER} GROUP BY method ORDER BY method"""),
    "quality": Report("Quality against the reference", f"""
        SELECT coalesce(task, '-') AS task, method, bool_or(lossy) AS lossy, quality_metric, count(*) AS scored,
               avg(quality) AS mean_quality
        FROM generations WHERE quality IS NOT NULL AND {RUN_FILTER} GROUP BY ALL ORDER BY task, lossy, method""",
        "ROUGE-L for summaries, exact match for computable code edits, token F1 for QA. lossy = the method may "
        "change the output (casd, casd_mixed): compare its quality with ar's, not only its speed."),
    "nodes": Report("Rows per node", f"""
        SELECT coalesce(node_id, '-') AS node_id, any_value(host) AS host, method, count(*) AS rows,
               count(error) AS errors, sum(new_tokens) AS new_tokens, count(DISTINCT actor_id) AS actors
        FROM generations WHERE {RUN_FILTER} GROUP BY ALL ORDER BY node_id, method""",
        "which Ray node's decode actors decoded the rows (`-`: decoded outside Ray)."),
    "errors": Report("Errors", f"""
        SELECT method, count(*) AS rows, count(error) AS errors,
               arg_max(error, error IS NOT NULL) FILTER (WHERE error IS NOT NULL) AS example_error
        FROM generations WHERE {RUN_FILTER} GROUP BY method ORDER BY method"""),
}


def run_report(con, name: str, run_id: str | None = None) -> pa.Table:
    return con.sql(REPORTS[name].sql, params={"run_id": run_id}).to_arrow_table()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def markdown_table(table: pa.Table) -> str:
    header = "| " + " | ".join(table.column_names) + " |"
    rule = "|" + "|".join("---" for _ in table.column_names) + "|"
    rows = ["| " + " | ".join(_cell(v) for v in row.values()) + " |" for row in table.to_pylist()]
    return "\n".join([header, rule, *rows]) if rows else header + "\n" + rule + "\n| (no rows) |"


def build_report(output: str | Path, run_id: str | None = None, con=None) -> tuple[str, dict[str, pa.Table]]:
    """-> (the Markdown text of every canned report, the tables by name); con: an open analysis connection."""
    if con is None:
        with connect(output) as con:
            return build_report(output, run_id, con)
    tables = {name: run_report(con, name, run_id) for name in REPORTS}
    scope = f"run {run_id}" if run_id else "all runs"
    parts = [f"# specbatch report: {output} ({scope})"]
    for name, report in REPORTS.items():
        parts.append(f"## {report.title}")
        if report.note:
            parts.append(report.note)
        parts.append(markdown_table(tables[name]))
    return "\n\n".join(parts) + "\n", tables


def write_report_files(output: str | Path, run_id: str | None, report_dir: Path,
                       plots: bool = True) -> tuple[str, list[Path]]:
    """report.md plus the PNG plots (speed-up bars, accepted-length histogram) in report_dir."""
    with connect(output) as con:
        text, tables = build_report(output, run_id, con)
        lengths = con.sql(f"SELECT method, list(mean_accepted_length) AS v FROM generations "
                          f"WHERE error IS NULL AND {RUN_FILTER} GROUP BY method", params={"run_id": run_id})
        lengths = lengths.to_arrow_table()
    report_dir.mkdir(parents=True, exist_ok=True)
    written = [report_dir / "report.md"]
    written[0].write_text(text, encoding="utf-8")
    if plots:
        for path in (speedup_bars(tables["speedup"], report_dir / "speedup.png"),
                     accepted_length_histogram({r["method"]: r["v"] for r in lengths.to_pylist()},
                                               report_dir / "accepted_length.png")):
            if path is not None:
                written.append(path)
    return text, written
