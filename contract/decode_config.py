"""What a decode actor needs of a run's configuration (the pipeline's `GenerationConfig` extends it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdec_core.defaults import (
    DEFAULT_BATCH_SIZE, DEFAULT_DETERMINISTIC, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MEMORY_TOKENS, DEFAULT_MODEL,
    determinism_mode,
)
from specdec_core.methods import METHODS, MethodOptions, check_method_names



class DecodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_id: str = Field("run", description="recorded with every output row")
    job: str = Field("generate", description="job name recorded with every row")
    methods: list[str] = Field(default_factory=lambda: ["ar", "copyspec"], min_length=1)
    model: str = DEFAULT_MODEL
    drafter: str | None = None
    drafter_dtype: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    deterministic: str = Field(
        DEFAULT_DETERMINISTIC, description="auto, on or off: every token's numbers the same in any batch or step, "
                                           "so lossless methods equal ar in bf16 too. auto: on where it costs nothing "
                                           "(ModelRunner.determinism_costs_nothing)")
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    method_options: MethodOptions = Field(default_factory=MethodOptions)
    batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, description="sequences decoded at once per actor")
    token_budget: int | None = Field(None, ge=1, description="most tokens one batched forward verifies (rows x "
                                                                "width, padding included); default: no cap")
    max_prompt_tokens: int | None = Field(None, ge=1, description="a longer prompt (any turn's) is an error row "
                                                                  "(default and cap: the model's context)")
    row_timeout_s: float | None = Field(None, gt=0, description="a row decoding longer than this gets an error row "
                                                                 "and frees its slot; default: no limit")
    hang_timeout_s: float | None = Field(None, gt=0, description="a decode actor whose forward has made no progress "
                                         "for this long ends its process, counted as a crash (default: 20x the "
                                         "slowest forward seen, at least 300 s)")
    memory_tokens: int = Field(DEFAULT_MEMORY_TOKENS, ge=0, description="suffix/auto: the job memory's bound in "
                               "output tokens per decode actor and method, oldest outputs evicted first (0: none)")
    memory_from: str | None = Field(None, description="suffix/auto: seed the job memory with the outputs of earlier "
                                                      "runs in this output directory (same tokenizer)")
    speculation_budget: bool = Field(True, description="draft lengths follow acceptance and measured step cost")
    decode_keys: dict[str, str] = Field(default_factory=dict, description="method -> the run's decode key (the "
                                                                            "output rows' `decode_key`)")

    @field_validator("deterministic", mode="before")
    @classmethod
    def _known_mode(cls, value) -> str:
        return determinism_mode(value)

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, methods: list[str]) -> list[str]:
        return check_method_names(methods)

    @model_validator(mode="after")
    def _drafter_when_needed(self) -> "DecodeConfig":
        needing = [m for m in self.methods if METHODS[m].needs_draft_model]
        if needing and not self.drafter:
            raise ValueError(f"method(s) {', '.join(needing)} need a drafter model (--drafter)")
        return self
