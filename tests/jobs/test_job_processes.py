"""A bad argument, seen from the process a user starts: exit status 2 and one line on stderr, nothing else there (no
import warning, no traceback). Every bad argument of every job is test_job_arguments.py's, in-process; the generation
jobs share one main (jobs/common.py), the refinement job has its own."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.mark.parametrize("job, args, fragment", [
    ("summarize.py", ["--method", "nope"], "unknown method"),
    ("refine_corpus.py", ["--input", "missing.jsonl"], "input not found"),
])
def test_a_bad_argument_is_one_line_from_the_process(job, args, fragment, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--output", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{job}: error:") and fragment in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_argument_check_and_the_reading_stages_load_without_torch():
    """A job's argument check and Ray Data's read and prompt stages import no torch (~7 s with transformers' models):
    a bad argument fails in under a second, and the workers that only read and tokenize rows start fast."""
    modules = ["jobs.common", "contract.decode_config", "pipelines.config", "operators.read_requests",
               "operators.build_prompts", "specdec_core.cli", "specdec_core.methods", "specdec_core"]
    code = f"import sys; [__import__(m) for m in {modules!r}]; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
