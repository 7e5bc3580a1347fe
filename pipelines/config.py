"""Configuration of a generation run (pydantic): what to read, which methods to run, where to write, resources."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from datetime import datetime, timezone
from typing import ClassVar

from pydantic import Field, field_validator

from contract.decode_config import DecodeConfig


RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]+")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


class GenerationConfig(DecodeConfig):
    """A whole run: the decode actor's part (`DecodeConfig`) plus what to read, where to write, resources."""

    input: str = Field(description="JSONL file, Parquet file or directory, 'hf:PATH' (datasets.load_from_disk), "
                                   "or a shipped workload 'workload:NAME'")
    output: str = Field(description="output directory: generations/ and runs/ are written below it")
    recursive: bool = Field(False, description="a directory input's subfolders are read too")
    task_template: str | None = Field(None, description="wraps each prompt: must contain {prompt}")
    default_task: str | None = Field(None, description="task of rows without one (picks the quality metric)")
    instruction: str | None = Field(None, description="edit instruction for `document` rows without their own")
    max_context_chars: int = Field(6000, ge=1, description="context characters put into a `question` row's prompt")
    compress_context: float | None = Field(None, ge=1, description="a `question` row's prompt carries its first "
                                           "max_context_chars of context compressed this many times (in tokens)")
    compression_model: str | None = Field(None, description="model scoring the compression (default: the target)")
    num_actors: int = Field(1, ge=1)
    cpus_per_actor: float | None = Field(None, gt=0, description="default: a fair share that leaves CPU for reads")
    num_gpus_per_actor: float = Field(0.0, ge=0)
    limit: int | None = Field(None, ge=1)
    rows_per_call: int | None = Field(None, ge=1, description="rows per decode-actor call (default: 4 x batch "
                                                                "size, at least 32)")
    resume: bool = False
    max_context_tokens: int = Field(1 << 20, ge=1, description="a longer `context` is an error row")
    max_error_fraction: float = Field(0.05, ge=0, le=1, description="past this share of error rows the job exits "
                                                                    "with status 3 (after writing everything)")
    run_id: str = Field(default_factory=new_run_id)

    @field_validator("run_id")
    @classmethod
    def _safe_run_id(cls, run_id: str) -> str:
        # The run id names directories under the output that are moved and removed: a path in it ("../..", "/x")
        # would make publish and cleanup act outside the output directory.
        if not RUN_ID_PATTERN.fullmatch(run_id) or set(run_id) == {"."}:
            raise ValueError(f"run id {run_id!r} must use only letters, digits, '.', '_' and '-' (and not be "
                             "'.' or '..')")
        return run_id

    @field_validator("task_template")
    @classmethod
    def _template_has_slot(cls, template: str | None) -> str | None:
        if template is not None and "{prompt}" not in template:
            raise ValueError("task_template must contain {prompt}")
        return template

    # Fields that change a row's output (with the request itself and the method): the resume key. Batch size,
    # token budget and actors change speed only (lossless methods give the same tokens at any batch size).
    # --max-prompt-tokens, --max-context-tokens and the row and hang timeouts only decide which rows fail, so they are not
    # part of it either: a resume with a larger limit does not redo the rows that succeeded.
    OUTPUT_FIELDS: ClassVar[tuple[str, ...]] = (
        "job", "model", "drafter", "drafter_dtype", "dtype", "device", "deterministic", "max_new_tokens", "temperature", "top_p",
        "top_k", "seed", "method_options", "task_template", "default_task", "instruction", "max_context_chars",
        "compress_context", "compression_model")

    def key_by_method(self) -> dict[str, str]:
        """method -> hash of the method and OUTPUT_FIELDS (stored on every output row as `decode_key`)."""
        values = self.model_dump(include=set(self.OUTPUT_FIELDS), mode="json")
        values["device"], values["dtype"] = self.resolved_device_and_dtype()
        if self.drafter_dtype == "auto":
            values["drafter_dtype"] = values["dtype"]
        return {method: hashlib.sha256(json.dumps({**values, "method": method}, sort_keys=True).encode())
                .hexdigest()[:16] for method in self.methods}

    def resolved_device_and_dtype(self) -> tuple[str, str]:
        """What "auto" becomes in the decode actors, so that a run resumed on a machine where `--dtype auto` means
        another dtype (bf16 with avx512_bf16, fp32 without) redoes its rows instead of mixing two dtypes. Resolved
        here, on the driver: actors without GPUs run on the CPU, and on one machine (the embedded cluster) its CPU
        decides; on a cluster whose nodes differ, pass --dtype explicitly."""
        from specdec_core.model.hardware import cpu_supports_bf16  # lazy: torch, only when the dtype is 'auto'

        device = self.device if self.device != "auto" else ("cuda" if self.num_gpus_per_actor > 0 else "cpu")
        if self.dtype != "auto":
            return device, self.dtype
        if device.startswith("cuda"):
            return device, "auto"  # bf16 or fp16 by the GPU, which only the actor sees
        return device, "bfloat16" if cpu_supports_bf16() else "float32"

    def decode_config(self) -> dict:
        """The fields a decode actor gets (as a plain dict: Ray ships it to the actor)."""
        return {**self.model_dump(include=set(DecodeConfig.model_fields)), "decode_keys": self.key_by_method()}

    def ray_batch_rows(self) -> int:
        """Rows per decode-actor call: enough that slots refill from the same call while long rows finish (the
        tail of a call decodes with fewer rows), and few enough that a killed actor redoes little."""
        return self.rows_per_call or max(4 * self.batch_size, 32)

    def with_calls_for_every_actor(self, rows: int) -> "GenerationConfig":
        """Without --rows-per-call, a job of few rows would be one call that only one of several actors decodes
        (slower than one actor; decisions.md: pipelines/config.py): split it so each actor gets a call."""
        if self.rows_per_call is not None or self.num_actors == 1 or rows <= 0:
            return self
        share = -(-rows // self.num_actors)  # ceil
        calls = min(self.ray_batch_rows(), max(self.batch_size, share))
        return self.model_copy(update={"rows_per_call": calls})

    def actor_cpus(self, cluster_cpus: float) -> float:
        """CPUs per actor. On a small machine a full CPU per actor starves the read tasks (a deadlock), so by
        default the actors share all but half a CPU."""
        if self.cpus_per_actor is not None:
            return self.cpus_per_actor
        if self.num_gpus_per_actor > 0:
            return 1.0
        # The light stages' share: reads and prompts (0.25 each), and the compression actor when there is one;
        # requests over the cluster's CPUs leave an actor unscheduled and the job waiting forever.
        reserved = 0.5 + (0.25 if self.compress_context is not None else 0.0)
        return max(0.25, (cluster_cpus - reserved) / self.num_actors)
