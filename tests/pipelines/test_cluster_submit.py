"""The job on a real Ray cluster: `ray start --head`, `ray job submit --working-dir .`, Parquet out, `ray stop`."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture
def cluster():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    start = subprocess.run([RAY, "start", "--head", "--num-cpus", "2", "--include-dashboard=true",
                            "--dashboard-host", "127.0.0.1", "--disable-usage-stats"],
                           capture_output=True, text=True, timeout=180, env=env)
    try:
        assert start.returncode == 0, start.stderr[-2000:]
        yield env
    finally:
        # Stop only what this test started; --force because a job may still hold workers on failure.
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=env)


def test_ray_job_submit_writes_the_output(cluster, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [RAY, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--",
         sys.executable, "jobs/summarize.py", "--input", "workload:sample", "--limit", "2", "--output", str(out),
         "--method", "ar", "--method", "copyspec", "--dtype", "float32"],
        capture_output=True, text=True, timeout=420, cwd=ROOT, env=cluster)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    rows = pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table().to_pylist()
    assert sorted((r["request_id"], str(r["method"])) for r in rows) == sorted(
        (rid, m) for rid in ("sample-rename", "sample-summary") for m in ("ar", "copyspec"))
    assert all(r["error"] is None and r["new_tokens"] > 0 for r in rows)
