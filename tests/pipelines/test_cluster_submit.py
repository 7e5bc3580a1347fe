"""The job on a real Ray cluster: `ray start --head`, `ray job submit --working-dir .`, Parquet out, `ray stop`."""

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as pads
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def cluster(tmp_path):
    """A head node of this test's own: `ray start --block` in a new session, stopped by ending its process tree,
    never `ray stop` (which stops every Ray cluster on the machine). Token authentication stays on, with a token in
    the environment only, and every server listens on loopback."""
    import psutil

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "ray_start.log", "w")
    # The dashboard agent's own port: its default (52365) is taken when another Ray instance runs on the machine
    # (the session's embedded cluster, tests/job_runs.py), and a head without its agent accepts no job.
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--num-cpus", "2", "--node-ip-address", "127.0.0.1",
                             "--include-dashboard=true", "--dashboard-host", "127.0.0.1", "--disable-usage-stats",
                             "--dashboard-agent-listen-port", str(_free_port())],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _dashboard_up():
            assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "ray_start.log").read_text()[-2000:]
            time.sleep(1)
        yield env
    finally:
        # The cluster is this test's alone and its output is read: killed outright (a graceful stop took ~15 s).
        for proc in [head] + _descendants(psutil, head.pid):
            _quietly(proc.kill)
        _quietly(lambda: head.wait(timeout=10))
        log.close()


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


def test_ray_job_submit_writes_the_output(cluster, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [RAY, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--",
         sys.executable, "jobs/summarize.py", "--input", "workload:sample", "--limit", "2", "--output", str(out),
         "--method", "ar", "--method", "copyspec", "--max-new-tokens", "8", "--dtype", "float32"],
        capture_output=True, text=True, timeout=420, cwd=ROOT, env=cluster)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    rows = pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table().to_pylist()
    assert sorted((r["request_id"], str(r["method"])) for r in rows) == sorted(
        (rid, m) for rid in ("sample-rename", "sample-summary") for m in ("ar", "copyspec"))
    assert all(r["error"] is None and r["new_tokens"] > 0 for r in rows)
