"""Jobs (and the CLI) run in the test process; a job that gets that far runs on the one embedded Ray cluster of the
test session (conftest's `ray_cluster`).

A job's main attaches to an initialised Ray instead of starting its own, so a small job costs ~20 s here against
~50 s as a process of its own (Python and torch imports, the cluster's start and stop: measured on 2 cores). The
process-level behaviour (exit status, nothing but one line on stderr) is test_job_processes.py's; a job that must be
killed, or that needs fault-injection variables in its workers, still runs as a process."""

from __future__ import annotations

import contextlib
import importlib
import io
from types import SimpleNamespace


def run_job(job: str, *args: str) -> SimpleNamespace:
    """jobs/JOB.py's main(args) -> (returncode, stdout, stderr), as `python jobs/JOB.py ARGS` would give them."""
    return run_main(importlib.import_module(f"jobs.{job.removesuffix('.py')}").main, *args)


def run_main(main, *args: str) -> SimpleNamespace:
    """A command's main(argv) in this process -> (returncode, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
    return SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())
