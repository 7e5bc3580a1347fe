"""The Ray generation pipeline end to end on the real default model: row accounting, schema, bad rows, resume."""

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.dataset as pads
import pytest

from contract.schema import GENERATIONS_SCHEMA

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def run_job(*args, timeout=480, env=None):
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "summarize.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="module")
def mixed_input(tmp_path_factory):
    """3 good rows (one multi-turn) and 4 bad ones: empty prompt, missing column, bad UTF-8, bad JSON."""
    good = [
        {"id": "good-1", "prompt": "Repeat exactly: alpha beta gamma delta."},
        {"id": "good-2", "messages": [{"role": "user", "content": "Count from one to five."}]},
        {"id": "good-3", "messages": [{"role": "user", "content": "Name two colors."}],
         "next_turns": ["Repeat your previous answer."]},
    ]
    lines = [json.dumps(r).encode() for r in good]
    lines += [json.dumps({"id": "bad-empty", "prompt": "   "}).encode(),
              json.dumps({"id": "bad-missing", "text": "no prompt column"}).encode(),
              b'{"id": "bad-utf8", "prompt": "caf\xe9"}',
              b'{"id": "bad-json", "prompt": ']
    return write_jsonl(tmp_path_factory.mktemp("input") / "mixed.jsonl", lines)


@pytest.fixture(scope="module")
def first_run(mixed_input, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    proc = run_job("--input", str(mixed_input), "--output", str(out), "--method", "ar", "--method", "copyspec",
                   "--max-new-tokens", "12", "--dtype", "float32", "--run-id", "run-a", "--batch-size", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def generations(out: Path):
    return pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table()


def test_every_row_once_per_method(first_run):
    out, summary = first_run
    table = generations(out)
    pairs = [(r["request_id"], r["method"]) for r in table.select(["request_id", "method"]).to_pylist()]
    assert len(pairs) == len(set(pairs)), "duplicated (request, method) rows"
    # 7 input rows; good-3 has two turns -> 8 request ids, each with both methods.
    assert summary["rows_in"] == 7 and summary["rows_out"] == 16 == len(pairs)
    ids = {p[0] for p in pairs}
    assert ids == {"good-1", "good-2", "good-3#t1", "good-3#t2", "bad-empty", "bad-missing", "mixed.jsonl:6",
                   "mixed.jsonl:7"}


def test_bad_rows_get_errors_and_good_rows_do_not(first_run):
    out, summary = first_run
    rows = {(r["request_id"], r["method"]): r for r in generations(out).to_pylist()}
    assert summary["errors"] == 8
    assert "empty prompt" in rows[("bad-empty", "ar")]["error"]
    assert "missing column" in rows[("bad-missing", "copyspec")]["error"]
    assert "UTF-8" in rows[("mixed.jsonl:6", "ar")]["error"]
    assert "JSON" in rows[("mixed.jsonl:7", "ar")]["error"]
    for key in [("good-1", "ar"), ("good-3#t2", "copyspec")]:
        assert rows[key]["error"] is None and rows[key]["new_tokens"] > 0
    # greedy copyspec is lossless: same ids as ar on every good request
    for request in ("good-1", "good-2", "good-3#t1", "good-3#t2"):
        assert rows[(request, "ar")]["output_token_ids"] == rows[(request, "copyspec")]["output_token_ids"]


def test_schema_is_the_contract_and_duckdb_reads_it(first_run):
    out, _ = first_run
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
    assert [r[0] for r in rows] == ["ar", "copyspec"] and all(r[1] == 8 for r in rows)
    runs = con.execute("SELECT run_id, rows_in, rows_out, errors FROM read_parquet(?, hive_partitioning = true)",
                       [str(out / "runs" / "**" / "*.parquet")]).fetchall()
    assert runs == [("run-a", 7, 16, 8)]


def test_runs_row_has_job_throughput_per_method_and_the_report_leads_with_it(first_run):
    out, _ = first_run
    con = duckdb.connect()
    stats = con.execute("SELECT unnest(method_stats, recursive := true) FROM read_parquet(?, hive_partitioning = "
                        "true)", [str(out / "runs" / "**" / "*.parquet")]).to_arrow_table().to_pylist()
    by_method = {s["method"]: s for s in stats}
    assert set(by_method) == {"ar", "copyspec"}
    rows = generations(out).to_pylist()
    for method, s in by_method.items():
        ok = [r for r in rows if r["method"] == method and r["error"] is None]
        assert s["requests"] == 8 and s["errors"] == 4 and s["new_tokens"] == sum(r["new_tokens"] for r in ok)
        assert s["job_tokens_per_s"] == pytest.approx(s["new_tokens"] / s["decode_wall_s"])
        assert 1 <= s["mean_occupancy"] <= 4 and s["peak_kv_bytes"] > 0 and s["actors"] == 1
        assert {r["batch_size"] for r in ok} == {4}
    assert by_method["copyspec"]["drafted_tokens"] >= by_method["copyspec"]["accepted_tokens"]
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "report.py"), "--output", str(out), "--no-plots",
                           "--report-dir", str(out / "report")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    report = (out / "report" / "report.md").read_text()
    first_section = report.split("## ")[1]
    assert first_section.startswith("Job throughput by method") and "| run-a | copyspec |" in first_section


def test_a_reused_run_id_is_refused_and_resume_of_a_finished_run_redoes_nothing(first_run, mixed_input):
    out, _ = first_run
    args = ["--input", str(mixed_input), "--output", str(out), "--method", "ar", "--method", "copyspec",
            "--max-new-tokens", "12", "--dtype", "float32", "--run-id", "run-a"]
    proc = run_job(*args, timeout=100)
    assert proc.returncode == 2 and "already has output" in proc.stderr and "--resume" in proc.stderr
    before = sorted(p.name for p in (out / "generations").rglob("*.parquet"))
    proc = run_job(*args, "--batch-size", "2", "--resume")  # batch size does not change outputs: nothing to redo
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped_pairs"] == 16
    assert sorted(p.name for p in (out / "generations").rglob("*.parquet")) == before
    assert (out / "generations" / "run_id=run-a" / "_SUCCESS").exists()


def test_driver_killed_mid_run_resumes_the_same_run_exactly_once(tmp_path):
    """SIGKILL the job after its first blocks are written; --resume finishes the same run: every pair once, no
    temporary file left, one runs row. Then a changed --max-new-tokens redoes every pair (new decode key)."""
    import os
    import signal
    import time

    rows = [json.dumps({"id": f"r{i}", "prompt": f"Write the number {i} in words, then count to ten."}).encode()
            for i in range(12)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    args = ["--input", str(source), "--output", str(out), "--method", "ar", "--max-new-tokens", "16",
            "--dtype", "float32", "--batch-size", "2", "--run-id", "nightly", "--rows-per-call", "2"]
    job = subprocess.Popen([sys.executable, str(ROOT / "jobs" / "summarize.py"), *args], cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run = out / "generations" / "run_id=nightly"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None and len(list(run.rglob("*.parquet"))) < 2:
        time.sleep(0.2)
    assert job.poll() is None, "the job finished before it could be killed: the test proved nothing"
    os.killpg(job.pid, signal.SIGKILL)  # the driver and the Ray processes it started
    job.wait()
    written = len(pads.dataset(str(run), format="parquet").to_table())
    assert 2 <= written < 12 and not (run / "_SUCCESS").exists()
    proc = run_job(*args[:-4], "--resume")  # no --run-id: the latest unfinished run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["run_id"] == "nightly"
    pairs = [(r["request_id"], r["method"]) for r in generations(out).to_pylist()]
    assert sorted(pairs) == sorted((f"r{i}", "ar") for i in range(12))
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")] and (run / "_SUCCESS").exists()
    proc = run_job(*[a if a != "16" else "8" for a in args], "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped_pairs"] == 0
    assert sum(r["new_tokens"] <= 8 for r in generations(out).to_pylist()) >= 12


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, fragment", [
    (["--method", "nope"], "unknown method"),
    (["--model", "no-such-model"], "unknown model"),
    (["--input", "/no/such/file.jsonl"], "input not found"),
    (["--method", "draft"], "drafter"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--run-id", "../x"], "run id"),
    (["--run-id", "/tmp/abs"], "run id"),
    (["--resume"], "no unfinished run"),
])
def test_bad_arguments_fail_fast_with_one_line(args, fragment, tmp_path):
    proc = run_job("--output", str(tmp_path), *args, timeout=100)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert not (tmp_path / "generations").exists()


def test_actor_killed_mid_run_is_replaced_and_rows_are_written_exactly_once(tmp_path):
    import os

    from operators.decode_requests import FAULT_ENV

    rows = [json.dumps({"id": f"r{i}", "prompt": f"Say the number {i}."}).encode() for i in range(6)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    marker = tmp_path / "killed"
    proc = run_job("--input", str(source), "--output", str(tmp_path / "out"), "--method", "ar", "--method",
                   "copyspec", "--max-new-tokens", "6", "--dtype", "float32",
                   env={**os.environ, FAULT_ENV: str(marker)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists(), "the fault was not injected, so the test proved nothing"
    pairs = [(r["request_id"], r["method"]) for r in generations(tmp_path / "out").to_pylist()]
    assert sorted(pairs) == sorted((f"r{i}", m) for i in range(6) for m in ("ar", "copyspec"))
