"""The job on a real two-node Ray cluster (a head and a worker `ray start` on this machine), through `ray job submit
--working-dir .`: both nodes used, a poison row, a hung row and a corrupt file; then the worker node lost mid-job."""

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.dataset as pads
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
# Every Python process of the test cluster (the CLI, the dashboard, the agents, the workers) keeps a loopback node
# address as given: Ray swaps it for the machine's outside address (services.resolve_ip_for_localhost), and its
# servers then listen on every interface (pipelines/generate.loopback_node_address does the same for the embedded
# cluster, in its one process).
LOOPBACK_SITECUSTOMIZE = """
try:
    from ray._private import services
    services.resolve_ip_for_localhost = lambda host: host
except Exception:
    pass
"""


@pytest.fixture
def cluster(tmp_path):
    """(Over ~50 lines: starting, waiting for and ending two nodes is one sequence whose cleanup must see it all.) Two Ray nodes of this test's own on this machine: a head and a worker (two raylets), each `ray start --block`
    in a new session, stopped by ending their process trees, never `ray stop` (which stops every Ray cluster on the
    machine). Token authentication stays on, with a token in the environment only, and every server listens on
    loopback. The head declares 3 CPUs and the worker 2 (the machine has 2 cores: the nodes share them; after the
    worker is lost, the head still fits the job's two 1-CPU actors and its light stages). Each keeps its files in a
    temporary directory of its own, removed afterwards: two nodes in one directory share the extracted job package,
    and one node's clean-up deleted the other's working directory."""
    import shutil
    import tempfile

    import psutil

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    (tmp_path / "loopback").mkdir()
    (tmp_path / "loopback" / "sitecustomize.py").write_text(LOOPBACK_SITECUSTOMIZE)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path / "loopback"), env.get("PYTHONPATH")]))
    gcs_port = _free_port()
    # Each node's dashboard agent needs a port of its own: the default (52365) is taken when another Ray instance
    # runs on the machine (the session's embedded cluster, tests/job_runs.py), and a head without its agent accepts
    # no job.
    common = ["--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    nodes, temp_dirs = [], [tempfile.mkdtemp(prefix="sbt-head-"), tempfile.mkdtemp(prefix="sbt-worker-")]
    try:
        head_log = tmp_path / "ray_head.log"
        nodes.append(subprocess.Popen(
            [RAY, "start", "--head", "--port", str(gcs_port), *common, "--num-cpus", "3", "--temp-dir", temp_dirs[0],
             "--include-dashboard=true",
             "--dashboard-host", "127.0.0.1", "--dashboard-agent-listen-port", str(_free_port())],
            stdout=open(head_log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        _wait(lambda: _dashboard_up(), nodes[0], head_log)
        worker_log = tmp_path / "ray_worker.log"
        nodes.append(subprocess.Popen(
            [RAY, "start", "--address", f"127.0.0.1:{gcs_port}", *common, "--num-cpus", "2", "--temp-dir", temp_dirs[1],
             "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port())],
            stdout=open(worker_log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True))
        _wait(lambda: "Ray runtime started" in worker_log.read_text(), nodes[1], worker_log)
        trees = {p.pid: p.name() for node in nodes for p in [psutil.Process(node.pid)] + _descendants(psutil, node.pid)}
        outside = [(trees[c.pid], c.laddr.ip) for c in psutil.net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN and c.pid in trees
                   and c.laddr.ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
        assert outside == [], outside
        yield SimpleNamespace(env=env, kill_worker=lambda: _kill_tree(psutil, nodes[1]))
    finally:
        # The cluster is this test's alone and its output is read: killed outright (a graceful stop took ~15 s).
        for node in reversed(nodes):
            _kill_tree(psutil, node)
        for directory in temp_dirs:
            shutil.rmtree(directory, ignore_errors=True)


def _kill_tree(psutil, node) -> None:
    for proc in [node] + _descendants(psutil, node.pid):
        _quietly(proc.kill)
    _quietly(lambda: node.wait(timeout=10))


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
    """(One scenario, over ~50 lines: each job submitted to a fresh two-node cluster costs ~1 minute, so the faults
    share one run.) `ray job submit` of the job with two decode actors, one on each node of the two-node cluster; every row records
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

    from tests.pipelines.fault_hooks import HANG_ENV, POISON_ENV, SETUP_HOOK

    source = tmp_path / "in"
    source.mkdir()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(12)],
                             "prompt": [f"Say the number {i}." for i in range(12)]}),
                   source / "good.parquet")
    (source / "corrupt.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    out = tmp_path / "out"
    proc = subprocess.run(
        [RAY, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".",
         "--runtime-env-json", json.dumps({"env_vars": {POISON_ENV: "r2", HANG_ENV: "r3"},
                                           "worker_process_setup_hook": SETUP_HOOK}), "--",
         sys.executable, "jobs/summarize.py", "--input", str(source), "--output", str(out), "--method", "copyspec",
         "--max-new-tokens", "6", "--dtype", "float32", "--rows-per-call", "2", "--max-error-fraction", "0.5",
         "--hang-timeout-s", "15", "--num-actors", "2", "--cpus-per-actor", "1"],
        capture_output=True, text=True, timeout=480, cwd=ROOT, env=cluster.env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    rows = pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table().to_pylist()
    ids = [f"r{i}" for i in range(12)] + ["corrupt.parquet"]
    assert sorted(r["request_id"] for r in rows) == sorted(ids) and {str(r["method"]) for r in rows} == {"copyspec"}
    for row in rows:
        if row["request_id"] in ("r2", "r3"):
            assert row["error"].startswith("decoding crashed the worker"), row["error"]
        elif row["request_id"] == "corrupt.parquet":
            assert "Parquet file corrupt.parquet cannot be read" in row["error"], row["error"]
        else:
            assert row["error"] is None and row["new_tokens"] > 0, row
    # One actor per node (SPREAD), one call in flight each: of 6+ calls, each actor decodes some
    decoded_on = {row["node_id"] for row in rows if row["error"] is None}
    assert len(decoded_on) == 2 and None not in decoded_on, decoded_on
    from analysis.reports import build_report

    _, tables = build_report(out)
    per_node = tables["nodes"].to_pylist()
    assert {r["node_id"] for r in per_node} >= decoded_on and sum(r["rows"] for r in per_node) == len(rows), per_node



def test_a_worker_node_lost_mid_job_costs_no_row(cluster, tmp_path):
    """The worker node (its raylet and every process under it) is killed while the job decodes on both nodes: the
    job finishes on the head with every (request, method) pair exactly once, no temporary file, and status 0. The
    lost actor's call is retried (the crash journal counts it as one of its batch's attempts) and the actor is
    restarted on the head."""
    import json

    rows = [json.dumps({"id": f"r{i}", "prompt": f"Count from {i} to {i + 30}, one number a line."}) for i in range(12)]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    submitted = subprocess.run(
        [RAY, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--no-wait", "--",
         sys.executable, "jobs/summarize.py", "--input", str(source), "--output", str(out), "--method", "ar",
         "--max-new-tokens", "48", "--dtype", "float32", "--rows-per-call", "2", "--num-actors", "2",
         "--cpus-per-actor", "1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=cluster.env)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job_id = re.search(r"raysubmit_\w+", submitted.stdout + submitted.stderr).group(0)
    run_files = lambda: list((out / "generations").rglob("*.parquet")) if (out / "generations").exists() else []
    deadline = time.monotonic() + 300
    while not run_files():  # both actors are up and one call is written: the other node is decoding
        assert time.monotonic() < deadline and _job_status(cluster.env, job_id) in ("PENDING", "RUNNING")
        time.sleep(1)
    cluster.kill_worker()
    assert len(run_files()) < 6, "every call was written before the node was lost: the test proved nothing"
    deadline = time.monotonic() + 420
    while (status := _job_status(cluster.env, job_id)) in ("PENDING", "RUNNING"):
        assert time.monotonic() < deadline, "the job did not finish after the node loss"
        time.sleep(2)
    logs = subprocess.run([RAY, "job", "logs", "--address", "http://127.0.0.1:8265", job_id], capture_output=True,
                          text=True, timeout=60, env=cluster.env).stdout
    assert status == "SUCCEEDED", logs[-3000:]
    table = pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table().to_pylist()
    assert sorted(r["request_id"] for r in table) == sorted(f"r{i}" for i in range(12)), logs[-3000:]
    assert all(r["error"] is None for r in table), [r["error"] for r in table if r["error"]]
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def _job_status(env: dict, job_id: str) -> str:
    proc = subprocess.run([RAY, "job", "status", "--address", "http://127.0.0.1:8265", job_id], capture_output=True,
                          text=True, timeout=60, env=env)
    # "Job 'ID' succeeded" once it ended, "Status for job 'ID': RUNNING" before; both in colour codes
    found = re.findall(r"(pending|running|succeeded|failed|stopped)", proc.stdout + proc.stderr, re.IGNORECASE)
    return found[-1].upper() if found else "UNKNOWN"
