"""The generation pipeline: read -> normalize -> prompts -> decode actors (every method per request) -> Parquet.

Stages are lazy Ray Data operators; nothing runs until the write. Light stages take a quarter CPU each so that the
decode actors can hold the rest without starving them (a 2-CPU cluster deadlocks with 2 actors x 1 CPU plus reads).
"""

from __future__ import annotations

import os
import platform
import time
from datetime import datetime, timezone

from .config import GenerationConfig
from .outputs import (
    RunLock, clean_temporary_files, count_rows, done_pairs, mark_finished, method_stats, run_dir,
    write_run_row,
)

LIGHT_TASK_CPUS = 0.25


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Embedded local Ray unless an address is given or we run under `ray job submit` (RAY_ADDRESS is set)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        # address="local": a plain ray.init() would silently attach to any `ray start` cluster on this machine.
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False)


def build_pipeline(config: GenerationConfig, done: frozenset[str] = frozenset()):
    """-> a lazy ray.data.Dataset of output rows (contract schema); `done` ("request_id\tmethod") pairs are
    dropped right after reading (--resume)."""
    import ray
    import ray.data

    from operators.build_prompts import BuildPrompts
    from operators.decode_requests import DecodeRequests
    from operators.read_requests import read_requests

    cluster_cpus = float(ray.cluster_resources().get("CPU", 1))
    actor_cpus = config.actor_cpus(cluster_cpus)
    # Blocks of one decode call's rows: a block flows through the stages as one unit (Ray Data merges a task's
    # outputs into one block), so its rows are written when that call finishes and a crash loses at most the calls
    # in flight. A whole JSONL file or Parquet row group in one block would be decoded and written all or nothing.
    requests = read_requests(config.input, config.limit, LIGHT_TASK_CPUS, rows_per_block=config.ray_batch_rows())
    prompts = requests.map_batches(
        BuildPrompts,
        fn_constructor_kwargs={"model": config.model, "task_template": config.task_template,
                               "instruction": config.instruction, "max_context_chars": config.max_context_chars,
                               "default_task": config.default_task, "done": done, "methods": config.methods},
        batch_format="pandas",
        batch_size=config.ray_batch_rows(),
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=LIGHT_TASK_CPUS,
    )
    return prompts.map_batches(
        DecodeRequests,
        fn_constructor_kwargs={
            "config": config.decode_config(),
            "torch_threads": max(1, round(actor_cpus)),
        },
        batch_format="pandas",
        batch_size=config.ray_batch_rows(),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=config.num_actors),
        num_cpus=actor_cpus,
        num_gpus=config.num_gpus_per_actor or None,
        # Ray Data's actor pools default to max_restarts=-1 and max_task_retries=-1: a dead actor is replaced and
        # its batch is redone, and since rows only reach the writer from finished batches none is written twice.
    )


class RunExistsError(RuntimeError):
    pass


def run_generation(config: GenerationConfig) -> dict:
    """Run the whole job; returns the run's summary (also written as one row of OUTPUT/runs/).

    Output blocks appear under generations/run_id=RUN/ as they finish (parquet_sink.py); the run ends with
    `_SUCCESS` and its runs/ row. With `resume`, the run's pairs already written with the same decode key are
    skipped. Without it, a run id that already has output is refused: a reused id never mixes two runs' rows.
    """
    from .parquet_sink import RunPartitionSink

    started_at = datetime.now(timezone.utc)
    started = time.perf_counter()
    with RunLock(config.output, config.run_id):
        exists = run_dir(config.output, config.run_id).exists()
        if exists and not config.resume:
            raise RunExistsError(f"run id {config.run_id!r} already has output in {config.output}: pass --resume to "
                                 "continue it, or choose another --run-id")
        clean_temporary_files(config.output, config.run_id)
        done = done_pairs(config.output, config.run_id, config.key_by_method()) if config.resume else frozenset()
        outputs = build_pipeline(config, done)
        outputs.write_datasink(RunPartitionSink(str(run_dir(config.output, config.run_id))),
                               ray_remote_args={"num_cpus": LIGHT_TASK_CPUS})
        rows_out, errors = count_rows(config.output, config.run_id)
        wall = time.perf_counter() - started
        summary = {
            "run_id": config.run_id,
            "job": config.job,
            "config": config.model_dump(),
            "versions": _versions(),
            "hardware": _hardware(),
            "started_at": started_at,
            "ended_at": datetime.now(timezone.utc),
            "rows_in": _count_input(config),
            "rows_out": rows_out,
            "errors": errors,
            "method_stats": method_stats(config.output, config.run_id),
        }
        write_run_row(config.output, summary)
        mark_finished(config.output, config.run_id)
    summary["wall_s"] = wall
    summary["skipped_pairs"] = len(done)
    return summary


def _count_input(config: GenerationConfig) -> int:
    from operators.read_requests import read_requests

    return read_requests(config.input, config.limit, LIGHT_TASK_CPUS).count()


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
