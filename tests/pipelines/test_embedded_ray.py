"""The embedded Ray cluster a job starts: token authentication on, no token file written, only loopback sockets,
workers at the job's own priority, and its files in a temporary directory of its own that is gone after the process
exits, its logs kept in the job's output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, os, psutil, ray
from pipelines.generate import init_ray

init_ray(None, num_cpus=1, output=os.environ["PROBE_OUTPUT"])
temp_dir = ray._private.worker._global_node.get_temp_dir_path()
worker_nice = ray.get(ray.remote(lambda: os.nice(0)).options(num_cpus=0).remote())  # a worker process listens too
tree = [psutil.Process()] + psutil.Process().children(recursive=True)
pids = {p.pid: p.name() for p in tree}
listening = [(pids[c.pid], c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN and c.pid in pids]
from ray._private.authentication.authentication_token_setup import AuthenticationMode, get_authentication_mode

print(json.dumps({"listening": listening, "token_auth": get_authentication_mode() == AuthenticationMode.TOKEN,
                  "worker_nice": worker_nice, "driver_nice": os.nice(0), "temp_dir": temp_dir}))
ray.shutdown()
"""


def test_embedded_cluster_uses_token_auth_listens_on_loopback_only_and_keeps_the_jobs_priority(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT), PROBE_OUTPUT=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    names = {name for name, _, _ in facts["listening"]}
    assert {"gcs_server", "raylet"} <= names, facts  # the probe sees the cluster's servers
    outside = [entry for entry in facts["listening"] if entry[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert outside == [], outside
    assert facts["token_auth"] is True
    # Ray starts workers at nice 15 by default: on 2 cores every nice-0 Ray process then preempts the actors' forwards.
    assert facts["worker_nice"] == facts["driver_nice"]
    assert list(home.rglob("*")) == []  # no ~/.ray/auth_token: the token lives in the environment only
    assert "specbatch-ray-" in facts["temp_dir"] and not os.path.exists(facts["temp_dir"])
    kept = list((tmp_path / "out" / "logs").glob("ray-*"))
    assert len(kept) == 1 and any(p.name.startswith("raylet") for p in kept[0].rglob("*")), kept
