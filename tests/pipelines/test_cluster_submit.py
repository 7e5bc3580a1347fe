"""The job on a real Ray cluster: `ray start --head`, `ray job submit --working-dir .` with a poison row and a
corrupt file, Parquet out, the head stopped."""

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as pads
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def cluster(tmp_path):
    """Two Ray nodes of this test's own on this machine: a head and a worker (two raylets), each `ray start --block`
    in a new session, stopped by ending their process trees, never `ray stop` (which stops every Ray cluster on the
    machine). Token authentication stays on, with a token in the environment only, and every server listens on
    loopback. Each node declares 2 CPUs (the machine has 2 cores: the nodes share them) and keeps its files in a
    temporary directory of its own, removed afterwards: two nodes in one directory share the extracted job package,
    and one node's clean-up deleted the other's working directory."""
    import shutil
    import tempfile

    import psutil

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    gcs_port = _free_port()
    # Each node's dashboard agent needs a port of its own: the default (52365) is taken when another Ray instance
    # runs on the machine (the session's embedded cluster, tests/job_runs.py), and a head without its agent accepts
    # no job.
    common = ["--block", "--num-cpus", "2", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    nodes, temp_dirs = [], [tempfile.mkdtemp(prefix="sbt-head-"), tempfile.mkdtemp(prefix="sbt-worker-")]
    try:
        head_log = tmp_path / "ray_head.log"
        nodes.append(subprocess.Popen(
            [RAY, "start", "--head", "--port", str(gcs_port), *common, "--temp-dir", temp_dirs[0],
             "--include-dashboard=true",
             "--dashboard-host", "127.0.0.1", "--dashboard-agent-listen-port", str(_free_port())],
            stdout=open(head_log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        _wait(lambda: _dashboard_up(), nodes[0], head_log)
        worker_log = tmp_path / "ray_worker.log"
        nodes.append(subprocess.Popen(
            [RAY, "start", "--address", f"127.0.0.1:{gcs_port}", *common, "--temp-dir", temp_dirs[1],
             "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())],
            stdout=open(worker_log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        _wait(lambda: "Ray runtime started" in worker_log.read_text(), nodes[1], worker_log)
        yield env
    finally:
        # The cluster is this test's alone and its output is read: killed outright (a graceful stop took ~15 s).
        for node in reversed(nodes):
            for proc in [node] + _descendants(psutil, node.pid):
                _quietly(proc.kill)
            _quietly(lambda: node.wait(timeout=10))
        for directory in temp_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def _wait(ready, proc, log: Path) -> None:
    deadline = time.monotonic() + 180
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(1)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _dashboard_up() -> bool:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen("http://127.0.0.1:8265", timeout=2)
        return True
    except urllib.error.HTTPError:  # it answers (401 without the token): it is up
        return True
    except OSError:
        return False


def _descendants(psutil, pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _quietly(action) -> None:
    try:
        action()
    except Exception:
        pass


def test_ray_job_submit_uses_both_nodes_and_survives_a_poison_row_a_hung_row_and_a_corrupt_file(cluster, tmp_path):
    """`ray job submit` of the job with two decode actors, one on each node of the two-node cluster; every row records
    the node that decoded it, and the report counts rows per node. The job meets three faults: row r2 kills its
    decode actor's process
    whenever it is decoded, mid-call (as a native crash, an OOM kill or a lost node would; the batch is tried twice,
    then redone one (request, method) at a time); row r3 never returns (as a deadlocked forward would), until the
    hang watchdog ends its process after --hang-timeout-s; and one input file is not Parquet. The actor is replaced
    after each death, r2, r3 and the corrupt file get error rows, and every other row, decoded in the calls that
    were killed, is written exactly once. The fault hooks reach the actors through the job's runtime environment.
    (One job for the submit and the faults: each was a job of its own, ~60 s of the suite apiece.)"""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from operators.decode_requests import HANG_ENV, POISON_ENV

    source = tmp_path / "in"
    source.mkdir()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"Say the number {i}." for i in range(6)]}),
                   source / "good.parquet")
    (source / "corrupt.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    out = tmp_path / "out"
    proc = subprocess.run(
        [RAY, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".",
         "--runtime-env-json", json.dumps({"env_vars": {POISON_ENV: "r2", HANG_ENV: "r3"}}), "--",
         sys.executable, "jobs/summarize.py", "--input", str(source), "--output", str(out), "--method", "copyspec",
         "--max-new-tokens", "6", "--dtype", "float32", "--rows-per-call", "2", "--max-error-fraction", "0.5",
         "--hang-timeout-s", "15", "--num-actors", "2", "--cpus-per-actor", "1"],
        capture_output=True, text=True, timeout=480, cwd=ROOT, env=cluster)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    rows = pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table().to_pylist()
    ids = [f"r{i}" for i in range(6)] + ["corrupt.parquet"]
    assert sorted(r["request_id"] for r in rows) == sorted(ids) and {str(r["method"]) for r in rows} == {"copyspec"}
    for row in rows:
        if row["request_id"] in ("r2", "r3"):
            assert row["error"].startswith("decoding crashed the worker"), row["error"]
        elif row["request_id"] == "corrupt.parquet":
            assert "Parquet file corrupt.parquet cannot be read" in row["error"], row["error"]
        else:
            assert row["error"] is None and row["new_tokens"] > 0, row
    decoded_on = {row["node_id"] for row in rows if row["error"] is None}
    assert len(decoded_on) == 2 and None not in decoded_on, decoded_on  # one actor per node (SPREAD)
    from analysis.reports import build_report

    _, tables = build_report(out)
    per_node = tables["nodes"].to_pylist()
    assert {r["node_id"] for r in per_node} >= decoded_on and sum(r["rows"] for r in per_node) == len(rows), per_node

