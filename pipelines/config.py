"""Configuration of a generation run (pydantic): what to read, which methods to run, where to write, resources."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdec_core.methods import METHODS, MethodOptions, check_method_names


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]


class GenerationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str = Field(description="JSONL file, Parquet file or directory, 'hf:PATH' (datasets.load_from_disk), "
                                   "or a shipped workload 'workload:NAME'")
    output: str = Field(description="output directory: generations/ and runs/ are written below it")
    job: str = Field("generate", description="job name recorded with every row")
    methods: list[str] = Field(default_factory=lambda: ["ar", "copyspec"], min_length=1)
    model: str = "smollm2-135m"
    drafter: str | None = None
    drafter_dtype: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    method_options: MethodOptions = Field(default_factory=MethodOptions)
    task_template: str | None = Field(None, description="wraps each prompt: must contain {prompt}")
    default_task: str | None = Field(None, description="task of rows without one (picks the quality metric)")
    instruction: str | None = Field(None, description="edit instruction for `document` rows without their own")
    max_context_chars: int = Field(6000, ge=1, description="context characters put into a `question` row's prompt")
    num_actors: int = Field(1, ge=1)
    cpus_per_actor: float | None = Field(None, gt=0, description="default: a fair share that leaves CPU for reads")
    num_gpus_per_actor: float = Field(0.0, ge=0)
    batch_size: int = Field(4, ge=1, description="rows per actor call")
    limit: int | None = Field(None, ge=1)
    resume: bool = False
    run_id: str = Field(default_factory=new_run_id)

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, methods: list[str]) -> list[str]:
        return check_method_names(methods)

    @field_validator("task_template")
    @classmethod
    def _template_has_slot(cls, template: str | None) -> str | None:
        if template is not None and "{prompt}" not in template:
            raise ValueError("task_template must contain {prompt}")
        return template

    @model_validator(mode="after")
    def _drafter_when_needed(self) -> "GenerationConfig":
        needing = [m for m in self.methods if METHODS[m].needs_draft_model]
        if needing and not self.drafter:
            raise ValueError(f"method(s) {', '.join(needing)} need a drafter model (--drafter)")
        return self

    def actor_cpus(self, cluster_cpus: float) -> float:
        """CPUs per actor. On a small machine a full CPU per actor starves the read tasks (measured deadlock with
        2 actors x 1 CPU on 2 CPUs), so by default the actors share all but half a CPU."""
        if self.cpus_per_actor is not None:
            return self.cpus_per_actor
        if self.num_gpus_per_actor > 0:
            return 1.0
        return max(0.25, (cluster_cpus - 0.5) / self.num_actors)
