"""The generation pipeline: read -> normalize -> prompts -> decode actors (every method per request) -> Parquet.

Stages are lazy Ray Data operators; nothing runs until the write. Light stages take a quarter CPU each so that the
decode actors can hold the rest without starving them (a 2-CPU cluster deadlocks with 2 actors x 1 CPU plus reads).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

from operators.build_prompts import BuildPrompts, SeenIds
from operators.compress_context import CompressContext
from operators.crash_journal import CrashJournal, max_task_retries
from operators.decode_requests import DecodeRequests
from operators.read_requests import read_requests

from .config import GenerationConfig
from .outputs import (
    RunLock,
    clean_temporary_files,
    count_rows,
    done_pairs,
    drop_duplicate_pairs,
    kernel_plans,
    longest_warmup,
    mark_finished,
    method_stats,
    run_dir,
    write_run_row,
)
from .progress import ErrorGate, RunProgress

LIGHT_TASK_CPUS = 0.25


def init_ray(address: str | None, num_cpus: int | None = None, output: str | None = None) -> None:
    """Embedded local Ray unless an address is given or we run under `ray job submit` (RAY_ADDRESS is set).

    Actor output (tracebacks, restarts) reaches the job's log; Ray's own logs only from warnings up, and Ray Data's
    per-second progress lines are off (progress.py draws the job's one bar). The embedded cluster keeps its files in
    a temporary directory of its own, removed when the process exits; its logs are first copied to
    OUTPUT/logs/ray-TIME/ (`output`; None: not kept), so a finished job leaves nothing in the machine's temp dir.
    """
    import logging

    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=True, logging_level=logging.WARNING)
    else:
        use_private_token()
        logging.getLogger("ray._private.authentication").setLevel(logging.ERROR)  # "token auth is on": it is ours
        # address="local": a plain ray.init() would silently attach to any `ray start` cluster on this machine.
        # A short path: Ray's unix sockets live under it, and a socket path may not exceed 107 bytes.
        temp_dir = tempfile.mkdtemp(prefix="specbatch-ray-")
        logs_to = None if output is None else os.path.join(
            output, "logs", "ray-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
        atexit.register(keep_logs_and_remove, temp_dir, logs_to)
        with loopback_node_address():
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                     log_to_driver=True, logging_level=logging.WARNING, _node_ip_address="127.0.0.1",
                     _system_config=QUIET_EMBEDDED_CLUSTER, _temp_dir=temp_dir)
    import ray.data

    # After the import: importing ray.data configures its loggers (INFO lines per execution on the console).
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    quiet_data_context()


def keep_logs_and_remove(temp_dir: str, logs_to: str | None) -> None:
    """At exit (registered after ray.init, so it runs before Ray's own shutdown hook): stop the embedded cluster,
    copy its logs to `logs_to`, remove its temporary directory."""
    import ray

    with contextlib.suppress(Exception):
        ray.shutdown()
    try:
        logs = Path(temp_dir) / "session_latest" / "logs"
        if logs_to is not None and logs.is_dir():
            shutil.copytree(logs, logs_to, dirs_exist_ok=True, ignore_dangling_symlinks=True,
                            ignore=shutil.ignore_patterns("*.sock"))
    except OSError as exc:  # the job's outputs are written already: a log copy that fails only says so
        print(f"specbatch: could not keep Ray's logs in {logs_to}: {exc}", file=sys.stderr)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


# What the embedded cluster changes from Ray's defaults, for the CPUs its actors share with Ray's own processes (on
# 2 cores every CPU-second another process takes is a second an actor's 2-thread forward waits):
# - worker_niceness 0: Ray starts workers at nice 15 so that its servers stay responsive on a busy node; here that let
#   every nice-0 process (raylet, GCS, agents, the driver's executor) preempt the actors.
# - no metrics or event-loop statistics: the embedded cluster has no dashboard, so nobody reads them.
# Each made the refinement job's scoring stage faster (decisions.md: pipelines/generate.py).
QUIET_EMBEDDED_CLUSTER = {"enable_metrics_collection": False, "event_stats": False, "worker_niceness": 0}


def quiet_data_context() -> None:
    """Ray Data work that runs beside the actors on the same CPUs and feeds nothing the jobs report (each job counts
    its own rows, tokens and seconds, and draws its own progress bar):
    - per-second progress lines;
    - statistics collection (its stats actor and the driver's executor took ~20 % of a 2-core machine in a profile);
    - a thread in every map task, the actors included, that reads the process's memory map (psutil USS) every second.
    """
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.memory_usage_poll_interval_s = None
    for flag in ("enable_auto_log_stats", "enable_stats_summary_collection", "enable_per_node_metrics",
                 "enable_get_object_locations_for_metrics"):
        if hasattr(context, flag):
            setattr(context, flag, False)


def allow_ray_remote_args() -> None:
    """Ray 2.60 takes max_restarts / max_task_retries (and a sink's CPUs) only as **ray_remote_args, deprecated for
    2.64, which has no named parameter for them yet: pinned Ray, warning silenced; revisit when upgrading."""
    warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated", category=Warning)


@contextlib.contextmanager
def loopback_node_address():
    """The embedded cluster serves this process only, so it listens on 127.0.0.1 alone. Ray's servers bind loopback
    when the node address is 127.0.0.1, but ray.init swaps a loopback `_node_ip_address` for the machine's outside
    address (services.resolve_ip_for_localhost); for this call it is kept as given. Checked by
    tests/pipelines/test_cluster_safety.py, which lists the cluster's listening sockets."""
    from ray._private import services

    original = getattr(services, "resolve_ip_for_localhost", None)
    if original is None:  # another Ray than the pinned one: it decides, and the test says so
        yield
        return
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


def use_private_token() -> None:
    """Token authentication for the embedded cluster without writing a token file: Ray would otherwise create
    ~/.ray/auth_token, outside the job's output. A random token lives in this process's environment, which Ray's
    processes inherit. A user's own RAY_AUTH_MODE / token is left as it is."""
    import secrets

    own = [os.environ.get(name) for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")]
    if not any(own) and not (Path.home() / ".ray" / "auth_token").exists():
        # RAY_AUTH_MODE stays unset: ray.init then turns token mode on for a new local cluster (and refreshes its
        # cached config, which setting the mode here, after `import ray`, would not) and finds this token.
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def build_pipeline(config: GenerationConfig, done: frozenset[str] = frozenset(), journal=None):
    """-> a lazy ray.data.Dataset of output rows (contract schema); `done` ("request_id\tmethod") pairs are
    dropped right after reading (--resume); `journal` (a CrashJournal actor) isolates rows that crash workers."""
    return _decode_stage(_prompt_stages(config, done), config, journal)


def _prompt_stages(config: GenerationConfig, done: frozenset[str]):
    """Read the requests, compress their context when asked, build the prompts -> a lazy Dataset of prompt rows."""
    # Blocks of one decode call's rows: a block flows through the stages as one unit (Ray Data merges a task's
    # outputs into one block), so its rows are written when that call finishes and a crash loses at most the calls
    # in flight. A whole JSONL file or Parquet row group in one block would be decoded and written all or nothing.
    requests = read_requests(config.input, config.limit, LIGHT_TASK_CPUS, rows_per_block=config.ray_batch_rows(),
                             recursive=config.recursive)
    allow_ray_remote_args()
    if config.compress_context is not None:

        # Its own actor with a scoring model (the prompt stage stays tokenizer-only); one forward per window of
        # context, small beside decoding a row with a small model.
        requests = one_light_actor(requests, CompressContext, config, {
            "model": config.compression_model or config.model, "ratio": config.compress_context,
            "max_context_chars": config.max_context_chars, "dtype": config.dtype})
    return one_light_actor(requests, BuildPrompts, config, {
        "model": config.model, "task_template": config.task_template, "max_prompt_tokens": config.max_prompt_tokens,
        "max_context_tokens": config.max_context_tokens, "instruction": config.instruction,
        "max_context_chars": config.max_context_chars, "default_task": config.default_task, "done": done,
        "methods": config.methods, "seen_ids": driver_actor(SeenIds)})


def _decode_stage(prompts, config: GenerationConfig, journal):
    """The decode actors over the prompt rows -> a lazy Dataset of output rows."""
    import ray
    import ray.data


    actor_cpus = config.actor_cpus(float(ray.cluster_resources().get("CPU", 1)))
    return prompts.map_batches(
        DecodeRequests,
        fn_constructor_kwargs={
            "config": config.decode_config(),
            "torch_threads": max(1, round(actor_cpus)),
            "journal": journal,
        },
        batch_format="pandas",
        batch_size=config.ray_batch_rows(),
        # One call in flight per actor: a call queued behind a poison row would otherwise die with it, again and
        # again, without the journal counting anything for it (decode calls take minutes: nothing is lost).
        # All --num-actors from the start (an autoscaling pool grew only when calls queued, so a short job on a
        # cluster could leave a node idle).
        compute=ray.data.ActorPoolStrategy(size=config.num_actors, max_tasks_in_flight_per_actor=1),
        num_cpus=actor_cpus,
        num_gpus=config.num_gpus_per_actor or None,
        # One actor per node before a second on any: on a cluster, --num-actors 2 uses two machines' CPUs.
        scheduling_strategy="SPREAD",
        # A dead actor is restarted and its call retried (rows reach the writer only from finished calls, so none
        # is written twice). Ray Data's default retries a call forever; with the journal each crash is progress,
        # so a call needs at most this many retries (crash_journal.py). Restarts stay unbounded: every restart
        # follows a crash the journal counted.
        max_restarts=-1,
        max_task_retries=max_task_retries(config.ray_batch_rows(), len(config.methods)) if journal else -1,
    )


def one_light_actor(dataset, stage, config: GenerationConfig, kwargs: dict):
    """A stage on one small actor (a quarter CPU) that sees every row. Its work cannot crash a worker on one row the
    way decoding can (limits are checked by length first), so a few retries cover a lost node, and a repeating crash
    fails the job instead of retrying forever."""
    import ray.data

    return dataset.map_batches(stage, fn_constructor_kwargs=kwargs, batch_format="pandas",
                               batch_size=config.ray_batch_rows(), compute=ray.data.ActorPoolStrategy(size=1),
                               num_cpus=LIGHT_TASK_CPUS, max_restarts=-1, max_task_retries=3)


def new_crash_journal():
    """The run's CrashJournal, on the driver's node (a job whose driver's node is gone is gone anyway). Restarted
    if it dies: it then forgets attempts, which costs extra attempts, never a row."""
    return driver_actor(CrashJournal)


def driver_actor(cls):
    """A small actor of the run's (no CPUs) on the driver's node, where the job lives or dies anyway."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, scheduling_strategy=here)(cls).remote()


class RunExistsError(RuntimeError):
    pass


def run_generation(config: GenerationConfig) -> dict:
    """Run the whole job; returns the run's summary (also written as one row of OUTPUT/runs/).

    Output blocks appear under generations/run_id=RUN/ as they finish (parquet_sink.py); the run ends with
    `_SUCCESS` and its runs/ row. With `resume`, the run's pairs already written with the same decode key are
    skipped. Without it, a run id that already has output is refused: a reused id never mixes two runs' rows.
    """
    import ray

    from .parquet_sink import STOP_FILE, RunPartitionSink, request_stop  # lazy: ray

    started_at = datetime.now(timezone.utc)
    started = time.perf_counter()
    with RunLock(config.output, config.run_id):
        exists = run_dir(config.output, config.run_id).exists()
        if exists and not config.resume:
            raise RunExistsError(f"run id {config.run_id!r} already has output in {config.output}: pass --resume to "
                                 "continue it, or choose another --run-id")
        clean_temporary_files(config.output, config.run_id)
        done = done_pairs(config.output, config.run_id, config.key_by_method()) if config.resume else frozenset()
        journal = new_crash_journal()
        try:
            rows_in = _count_input(config)
            config = config.with_calls_for_every_actor(rows_in)
            outputs = build_pipeline(config, done, journal)
            directory = run_dir(config.output, config.run_id)
            (directory / STOP_FILE).unlink(missing_ok=True)  # an earlier stopped job's: --resume goes on
            gate = ErrorGate(config.max_error_fraction, max(1, rows_in * len(config.methods) - len(done)),
                             stop=lambda: _stop_quietly(directory))
            progress = RunProgress(directory, total=rows_in * len(config.methods), gate=gate)
            ray_data_level = logging.getLogger("ray.data").level  # _stop_quietly's change is undone below
            try:
                with progress:
                    outputs.write_datasink(RunPartitionSink(str(directory)),
                                           ray_remote_args={"num_cpus": LIGHT_TASK_CPUS})
            except Exception:  # the gate's stop reaches here as the dataset's failure
                if progress.stopped is None:
                    raise
            finally:
                (directory / STOP_FILE).unlink(missing_ok=True)
                logging.getLogger("ray.data").setLevel(ray_data_level)
        finally:
            ray.kill(journal)
        drop_duplicate_pairs(config.output, config.run_id)
        if progress.stopped is not None:  # unfinished, as an interrupted run: --resume goes on from here
            rows_out, errors = count_rows(config.output, config.run_id)
            return {"run_id": config.run_id, "rows_in": rows_in, "rows_out": rows_out, "errors": errors,
                    "wall_s": time.perf_counter() - started, "skipped_pairs": len(done),
                    "stopped_early": progress.stopped}
        summary = _run_row(config, started_at, rows_in)
        wall = time.perf_counter() - started
        write_run_row(config.output, summary)
        mark_finished(config.output, config.run_id)
    summary["wall_s"] = wall
    summary["skipped_pairs"] = len(done)
    return summary


def _stop_quietly(directory: Path) -> None:
    """The error gate's stop: the run's sink ends the dataset, which Ray Data reports as a failed task with its
    traceback (three of them); the job prints its own line instead (jobs/common.py)."""
    from .parquet_sink import request_stop  # lazy: ray

    logging.getLogger("ray.data").setLevel(logging.CRITICAL)
    request_stop(directory)


def _run_row(config: GenerationConfig, started_at: datetime, rows_in: int) -> dict:
    """The finished run's row of OUTPUT/runs/: its config, versions, hardware, times, row counts and methods' stats."""
    rows_out, errors = count_rows(config.output, config.run_id)
    return {
        "run_id": config.run_id,
        "job": config.job,
        "config": config.model_dump(),
        "versions": _versions(),
        "hardware": {**_hardware(), **kernel_plans(config.output, config.run_id)},
        "started_at": started_at,
        "ended_at": datetime.now(timezone.utc),
        "rows_in": rows_in,
        "rows_out": rows_out,
        "errors": errors,
        "method_stats": method_stats(config.output, config.run_id),
        "warmup_s": longest_warmup(config.output, config.run_id),
    }


def _count_input(config: GenerationConfig) -> int:
    return read_requests(config.input, config.limit, LIGHT_TASK_CPUS, recursive=config.recursive).count()


def _versions() -> dict:
    import ray
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "ray": ray.__version__}


def _hardware() -> dict:
    import ray

    return {"machine": platform.machine(), "processor": platform.processor(), "node": platform.node(),
            "cluster_resources": ray.cluster_resources()}
