"""The Ray generation pipeline end to end on the real default model: row accounting, schema, bad rows, resume, a
killed driver. Jobs run in-process on the session's Ray cluster (tests/job_runs.py), except the one a driver's kill
needs in a process of its own. A killed actor, a poison row and a corrupt file: test_cluster_submit.py's job."""

import json
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.dataset as pads
import pytest

from contract.schema import GENERATIONS_SCHEMA
from tests.job_runs import run_job as run_job_in_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def run_job(*args):
    return run_job_in_process("summarize.py", *args)


def write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


LONG_TURN = "Please repeat this word list. " + "word " * 1100  # over --max-prompt-tokens 1000 below


@pytest.fixture(scope="module")
def mixed_input(tmp_path_factory):
    """4 good rows (two multi-turn) and 12 bad ones, each a case a nightly job meets: empty prompt, missing column,
    bad UTF-8, bad JSON, an unknown chat role, a repeated id, a lone surrogate, max_new_tokens of 1e400 / 3.7 /
    true, a prompt over --max-prompt-tokens, a context over --max-context-tokens. The second multi-turn row's
    second turn is over the prompt limit: turns 2 and 3 get error rows of their own."""
    good = [
        {"id": "good-1", "prompt": "Repeat exactly: alpha beta gamma delta."},
        {"id": "good-2", "messages": [{"role": "user", "content": "Count from one to five."}]},
        {"id": "good-3", "messages": [{"role": "user", "content": "Name two colors."}],
         "next_turns": ["Repeat your previous answer."]},
        {"id": "late-fail", "prompt": "Say hello.", "next_turns": [LONG_TURN, "And again."]},
    ]
    lines = [json.dumps(r).encode() for r in good]
    lines += [json.dumps({"id": "bad-empty", "prompt": "   "}).encode(),
              json.dumps({"id": "bad-missing", "text": "no prompt column"}).encode(),
              b'{"id": "bad-utf8", "prompt": "caf\xe9"}',
              b'{"id": "bad-json", "prompt": ',
              json.dumps({"id": "bad-role", "messages": [{"role": "robot", "content": "beep"}]}).encode(),
              json.dumps({"id": "good-1", "prompt": "A second row with the first row's id."}).encode(),
              b'{"id": "bad-surrogate", "prompt": "half a pair: \\ud800"}',
              b'{"id": "bad-max-huge", "prompt": "Hi.", "max_new_tokens": 1e400}',
              b'{"id": "bad-max-frac", "prompt": "Hi.", "max_new_tokens": 3.7}',
              b'{"id": "bad-max-bool", "prompt": "Hi.", "max_new_tokens": true}',
              json.dumps({"id": "bad-long", "prompt": "word " * 1100}).encode(),
              json.dumps({"id": "bad-context", "question": "Which animal?", "context": "A cat sat. " * 200}).encode()]
    return write_jsonl(tmp_path_factory.mktemp("input") / "mixed.jsonl", lines)


GOOD_IDS = {"good-1", "good-2", "good-3#t1", "good-3#t2", "late-fail#t1"}
BAD_IDS = {"bad-empty", "bad-missing", "mixed.jsonl:7", "mixed.jsonl:8", "bad-role", "good-1#dup-2", "bad-surrogate",
           "bad-max-huge", "bad-max-frac", "bad-max-bool", "bad-long", "bad-context", "late-fail#t2", "late-fail#t3"}


@pytest.fixture(scope="module")
def first_run(ray_cluster, mixed_input, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    proc = run_job("--input", str(mixed_input), "--output", str(out), "--method", "ar", "--method", "copyspec",
                   "--max-new-tokens", "12", "--dtype", "float32", "--run-id", "run-a", "--batch-size", "4",
                   "--max-prompt-tokens", "1000", "--max-context-tokens", "500")
    # Everything is written, then the share of error rows (14 of 19 per method) is over the default 5%.
    assert proc.returncode == 3, proc.stderr[-3000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def generations(out: Path):
    return pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table()


def test_every_row_once_per_method(first_run):
    out, summary, _ = first_run
    pairs = [(r["request_id"], r["method"], r["error"] is None)
             for r in generations(out).select(["request_id", "method", "error"]).to_pylist()]
    # 16 input rows; good-3 has two turns and late-fail three -> 19 output rows per method; the second row with id
    # "good-1" is the error row of request "good-1#dup-2".
    assert summary["rows_in"] == 16 and summary["rows_out"] == 38 == len(pairs)
    assert sorted(pairs) == sorted([(i, m, True) for i in GOOD_IDS for m in ("ar", "copyspec")]
                                   + [(i, m, False) for i in BAD_IDS for m in ("ar", "copyspec")])


def test_bad_rows_get_errors_and_good_rows_do_not(first_run):
    out, summary, stderr = first_run
    rows = {(r["request_id"], r["method"], r["error"] is None): r for r in generations(out).to_pylist()}
    error = {(request, method): row["error"] for (request, method, ok), row in rows.items() if not ok}
    assert len(rows) == 38
    assert summary["errors"] == 28
    assert "empty prompt" in error[("bad-empty", "ar")]
    assert "missing column" in error[("bad-missing", "copyspec")]
    assert "UTF-8" in error[("mixed.jsonl:7", "ar")]
    assert "JSON" in error[("mixed.jsonl:8", "ar")]
    assert "role 'robot'" in error[("bad-role", "ar")]
    assert "duplicate id 'good-1'" in error[("good-1#dup-2", "ar")]
    assert "surrogate" in error[("bad-surrogate", "copyspec")]
    for request in ("bad-max-huge", "bad-max-frac", "bad-max-bool"):
        assert "max_new_tokens must be a whole number" in error[(request, "ar")], request
    assert "--max-prompt-tokens" in error[("bad-long", "ar")]
    assert "--max-context-tokens" in error[("bad-context", "ar")]
    assert "--max-prompt-tokens" in error[("late-fail#t2", "ar")]
    assert error[("late-fail#t3", "copyspec")].startswith("turn 2 failed, so this turn was not decoded")
    for key in [("good-1", "ar", True), ("good-3#t2", "copyspec", True), ("late-fail#t1", "ar", True)]:
        assert rows[key]["new_tokens"] > 0
    # greedy copyspec is lossless: same ids as ar on every good request
    for request in GOOD_IDS:
        assert rows[(request, "ar", True)]["output_token_ids"] == rows[(request, "copyspec", True)]["output_token_ids"]
    # the job says why it failed: the share over --max-error-fraction, and the most common errors
    assert "over --max-error-fraction 0.05 (exit status 3)" in stderr
    assert "28 of 38 output rows are errors; the most common:" in stderr
    assert stderr.count(" x ") >= 5  # five kinds, each with its count


def test_schema_is_the_contract_and_duckdb_reads_it(first_run):
    out, _, _ = first_run
    files = list((out / "generations").rglob("*.parquet"))
    assert files and not list(out.rglob("*.tmp")) and not (out / "_staging" / "run-a").exists()
    table = generations(out)
    expected = {f.name: f.type for f in GENERATIONS_SCHEMA}
    got = {f.name: f.type for f in table.schema}
    for name in expected:
        if name in ("run_id", "method"):
            continue  # hive partition columns, read back as dictionary strings
        assert got[name] == expected[name], name
    con = duckdb.connect()
    glob = str(out / "generations" / "**" / "*.parquet")
    rows = con.execute(
        "SELECT method, count(*), sum(new_tokens), max(accepted_by_source['target']) FROM read_parquet(?, "
        "hive_partitioning = true) GROUP BY method ORDER BY method", [glob]).fetchall()
    assert [r[0] for r in rows] == ["ar", "copyspec"] and all(r[1] == 19 for r in rows)
    runs = con.execute("SELECT run_id, rows_in, rows_out, errors FROM read_parquet(?, hive_partitioning = true)",
                       [str(out / "runs" / "**" / "*.parquet")]).fetchall()
    assert runs == [("run-a", 16, 38, 28)]


def test_runs_row_has_job_throughput_per_method_and_the_report_leads_with_it(first_run):
    out, _, stderr = first_run
    # the job's own summary: the warm-up apart, then each method's figures against ar's, prefill and decode apart
    assert re.search(r"warm-up before timing \(kernels, first forwards\): \d+\.\d s", stderr), stderr[-2000:]
    for method in ("ar", "copyspec"):
        assert re.search(rf"\n{method} +rows +19 +errors +14 +tokens +\d+ +tok/s +[\d.]+ \([\d.]+x ar\) +prefill "
                         r"[\d.]+ s +decode tok/s +[\d.]+ \([\d.]+x ar\) +accepted length [\d.]+", stderr), stderr[-2000:]
    con = duckdb.connect()
    stats = con.execute("SELECT unnest(method_stats, recursive := true) FROM read_parquet(?, hive_partitioning = "
                        "true)", [str(out / "runs" / "**" / "*.parquet")]).to_arrow_table().to_pylist()
    by_method = {s["method"]: s for s in stats}
    assert set(by_method) == {"ar", "copyspec"}
    rows = generations(out).to_pylist()
    for method, s in by_method.items():
        ok = [r for r in rows if r["method"] == method and r["error"] is None]
        assert s["requests"] == 19 and s["errors"] == 14 and s["new_tokens"] == sum(r["new_tokens"] for r in ok)
        assert s["job_tokens_per_s"] == pytest.approx(s["new_tokens"] / s["decode_wall_s"])
        assert 1 <= s["mean_occupancy"] <= 4 and s["peak_kv_bytes"] > 0 and s["actors"] == 1
        assert {r["batch_size"] for r in ok} == {4}
        # the wall time split: prefill forwards and the rest, each with its rate
        assert s["prefill_s"] > 0 and s["decode_s"] > 0
        assert s["prefill_s"] + s["decode_s"] == pytest.approx(s["decode_wall_s"])
        assert s["decode_tokens_per_s"] == pytest.approx(s["new_tokens"] / s["decode_s"])
    # the actor warmed up before its first timed pass, and the runs row keeps the longest warm-up
    warmups = {r["actor_warmup_s"] for r in rows if r["decode_pass"] is not None}
    assert len(warmups) == 1 and warmups.pop() > 0
    [(warmup,)] = con.execute("SELECT warmup_s FROM read_parquet(?, hive_partitioning = true)",
                              [str(out / "runs" / "**" / "*.parquet")]).fetchall()
    assert warmup > 0
    # fp32 follows no kernel plan (it stays exact): the rows and the runs row say so
    [(hardware,)] = con.execute("SELECT hardware FROM read_parquet(?, hive_partitioning = true)",
                                [str(out / "runs" / "**" / "*.parquet")]).fetchall()
    assert json.loads(hardware)["kernel_plans"] == [] and {r["kernel_plan"] for r in rows} == {None}
    assert by_method["copyspec"]["drafted_tokens"] >= by_method["copyspec"]["accepted_tokens"]
    proc = run_job_in_process("report.py", "--output", str(out), "--no-plots", "--report-dir", str(out / "report"))
    assert proc.returncode == 0, proc.stderr
    report = (out / "report" / "report.md").read_text()
    first_section = report.split("## ")[1]
    assert first_section.startswith("Job throughput by method") and "| run-a | copyspec |" in first_section


def session_processes(session: int) -> list[int]:
    """Live (not zombie) processes of a session. Ray's workers each lead their own process group, so killpg on the
    driver's group leaves them writing blocks until they notice the raylet is gone; they stay in the session."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session, ...
        except OSError:  # the process ended while listed
            continue
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):
            pids.append(int(stat.parent.name))
    return pids


def kill_session(session: int, wait_s: float = 30.0) -> None:
    """SIGKILL every process of a session until none is left alive (none can start one once the raylet is gone)."""
    import os
    import signal
    import time

    deadline = time.monotonic() + wait_s
    while pids := session_processes(session):
        assert time.monotonic() < deadline, f"processes {pids} outlived SIGKILL"
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def test_driver_killed_mid_run_resumes_the_same_run_exactly_once(ray_cluster, tmp_path):
    """SIGKILL the job after its first blocks are written; --resume (with another --batch-size, which does not
    change outputs, so the written pairs still count as done) finishes the same run: every pair once, no temporary
    file left, one runs row. (A reused run id without --resume is refused: test_job_arguments.py.)"""
    import time

    rows = [json.dumps({"id": f"r{i}", "prompt": f"Write the number {i} in words, then count to ten."}).encode()
            for i in range(12)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    common = ["--input", str(source), "--output", str(out), "--method", "ar", "--max-new-tokens", "8",
              "--dtype", "float32"]
    args = common + ["--batch-size", "2", "--run-id", "nightly", "--rows-per-call", "2"]
    job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "summarize.py"), *args], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run = out / "generations" / "run_id=nightly"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None and len(list(run.rglob("*.parquet"))) < 2:
        time.sleep(0.2)
    assert job.poll() is None, "the job finished before it could be killed: the test proved nothing"
    kill_session(job.pid)  # the driver and every Ray process it started, as a lost machine would stop them
    job.wait()
    written = len(pads.dataset(str(run), format="parquet").to_table())
    assert 2 <= written < 12 and not (run / "_SUCCESS").exists()
    proc = run_job(*common, "--batch-size", "3", "--resume")  # no --run-id: the latest unfinished run
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["run_id"] == "nightly" and summary["skipped_pairs"] == written
    pairs = [(r["request_id"], r["method"]) for r in generations(out).to_pylist()]
    assert sorted(pairs) == sorted((f"r{i}", "ar") for i in range(12))
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")] and (run / "_SUCCESS").exists()
    # (That a changed --max-new-tokens redoes every pair is test_run_output.py's decode-key tests: a third job here
    # cost ~30 s of the suite.)
