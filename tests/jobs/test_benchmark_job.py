"""The benchmark job on a tiny request set: runs, throughput table, and HF batch-1 greedy identical to our ar."""

import json

import pytest

from tests.job_runs import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_benchmark_reports_speedups_throughput_and_the_hf_peer(ray_cluster, tmp_path):
    proc = run_job("benchmark.py", "--output", str(tmp_path), "--workload", "sample", "--per-workload", "2",
                   "--max-new-tokens", "8", "--method", "ar", "--method", "copyspec", "--actors", "1",
                   "--hf-batch-sizes", "1,2", "--dtype", "float32", "--batch-size", "2", "--candidates", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "benchmark" / "benchmark.json").read_text())
    assert result["config"]["batch_size"] == 2 and result["config"]["method_options"]["candidates"] == 2
    (run,) = result["pipeline_runs"]
    assert run["actors"] == 1 and run["errors"] == 0 and run["new_tokens"] > 0
    # 2 sample rows (a code edit and a summary) x 2 methods, at most 8 new tokens each.
    assert run["new_tokens"] <= 2 * 2 * 8
    assert {m["method"] for m in result["methods_in_speedup_run"]} == {"ar", "copyspec"}
    peers = {p["batch_size"]: p for p in result["hf_generate"]}
    assert set(peers) == {1, 2} and peers[1]["requests"] == 2
    # HF greedy at batch 1 in fp32 decodes exactly what our ar decoded.
    assert peers[1]["same_as_ar"] == 2
    markdown = (tmp_path / "benchmark" / "benchmark.md").read_text()
    assert "Speed-up over ar" in markdown and "HF generate greedy, batch 1" in markdown
    assert (tmp_path / "benchmark" / "speedup.png").exists()
