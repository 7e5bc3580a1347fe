"""Benchmark through the real pipeline: every chosen method on the shipped workloads (speed-up over ar per request),
whole-job throughput with 1 and 2 decode actors, and HF `generate` greedy at its best batch size on the same
requests (the batch-job peer)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from analysis.views import connect
from operators.build_prompts import BuildPrompts
from operators.read_requests import check_input_path, workload_rows
from operators.requests_schema import normalize_row, requests_table
from pipelines.config import GenerationConfig
from pipelines.generate import run_generation
from specdec_core.defaults import DEFAULT_BATCH_SIZE, DEFAULT_MODEL
from specdec_core.methods import MethodOptions, check_method_names

DEFAULT_WORKLOADS = ["summarization", "code_edit", "rag", "multi_turn"]


class BenchmarkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output: str = Field(description="directory for the runs, the request set and the benchmark report")
    workloads: list[str] = Field(default_factory=lambda: list(DEFAULT_WORKLOADS), min_length=1)
    per_workload: int = Field(3, ge=1, description="requests taken from each workload")
    methods: list[str] = Field(default_factory=lambda: ["ar", "pld", "copyspec"], min_length=1)
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_new_tokens: int = Field(128, ge=1)
    method_options: MethodOptions = Field(default_factory=MethodOptions)
    actors: list[int] = Field(default_factory=lambda: [1, 2], description="decode-actor counts to time the job with")
    hf_batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16], description="[] skips the HF peer")
    batch_size: int = Field(DEFAULT_BATCH_SIZE, ge=1, description="sequences each decode actor decodes at once")
    token_budget: int | None = Field(None, ge=1, description="most tokens one batched forward verifies")
    speculation_budget: bool = Field(True, description="draft lengths follow acceptance and measured step cost")

    @field_validator("methods")
    @classmethod
    def _ar_and_known(cls, methods: list[str]) -> list[str]:
        if "ar" not in check_method_names(methods):
            raise ValueError("speed-ups are measured against ar: include --method ar")
        return methods

    @field_validator("workloads")
    @classmethod
    def _known_workloads(cls, workloads: list[str]) -> list[str]:

        for workload in workloads:
            check_input_path(f"workload:{workload}")  # raises SpecbatchError naming the choices
        return workloads

    @field_validator("actors", "hf_batch_sizes")
    @classmethod
    def _positive(cls, values: list[int]) -> list[int]:
        if any(v < 1 for v in values):
            raise ValueError("counts must be >= 1")
        return values


def write_request_set(config: BenchmarkConfig) -> Path:
    """The first per_workload rows of each workload, as one JSONL input (each row's own limit capped)."""

    path = Path(config.output) / "benchmark_requests.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for workload in config.workloads:
            for row in workload_rows(workload, config.per_workload)[:config.per_workload]:
                row["max_new_tokens"] = min(row.get("max_new_tokens") or config.max_new_tokens, config.max_new_tokens)
                handle.write(json.dumps(row) + "\n")
    return path


def run_pipeline(config: BenchmarkConfig, requests: Path, actors: int, run_id: str) -> dict:

    generation = GenerationConfig(input=str(requests), output=config.output, job="benchmark", methods=config.methods,
                                  model=config.model, dtype=config.dtype, max_new_tokens=config.max_new_tokens,
                                  method_options=config.method_options, num_actors=actors, run_id=run_id,
                                  batch_size=config.batch_size, token_budget=config.token_budget,
                                  speculation_budget=config.speculation_budget)
    summary = run_generation(generation)
    new_tokens = _run_new_tokens(config.output, run_id)
    return {"run_id": run_id, "actors": actors, "wall_s": summary["wall_s"], "new_tokens": new_tokens,
            "tokens_per_s": new_tokens / summary["wall_s"], "errors": summary["errors"]}


def _select(output: str, sql: str, run_id: str) -> list[dict]:
    """Our own queries over the live views (no sandbox copy: they are not user SQL)."""

    with connect(output) as con:
        return con.sql(sql, params={"run": run_id}).to_arrow_table().to_pylist()


def _run_new_tokens(output: str, run_id: str) -> int:
    rows = _select(output, "SELECT coalesce(sum(new_tokens), 0) AS n FROM generations "
                           "WHERE run_id = $run AND error IS NULL", run_id)
    return int(rows[0]["n"])


def method_throughput(output: str, run_id: str) -> list[dict]:
    """Per method of one run: new tokens / the wall time of that method's batched decoder passes (each pass once).
    Summing the requests' own wall_s would count a batch's time once per row in it."""
    return _select(output, """
        WITH passes AS (SELECT DISTINCT method, decode_pass, pass_wall_s FROM generations
                        WHERE run_id = $run AND decode_pass IS NOT NULL),
             tokens AS (SELECT method, sum(new_tokens)::BIGINT AS new_tokens FROM generations
                        WHERE run_id = $run AND error IS NULL GROUP BY method)
        SELECT t.method, t.new_tokens, sum(p.pass_wall_s) AS decode_s, t.new_tokens / sum(p.pass_wall_s) AS tokens_per_s
        FROM tokens t JOIN passes p USING (method) GROUP BY t.method, t.new_tokens ORDER BY t.method""", run_id)


def prepared_requests(config: BenchmarkConfig, requests: Path) -> list[dict]:
    """The request set through the pipeline's own normalize + prompt stages (same prompt ids), usable rows only."""

    raw = [json.loads(line) for line in requests.read_text(encoding="utf-8").splitlines() if line.strip()]
    normalized = requests_table([normalize_row(r) for r in raw]).to_pandas()
    rows = BuildPrompts(config.model)(normalized).to_pylist()
    prepared = []
    for row in rows:
        if row["input_error"]:
            continue
        messages = json.loads(row["messages"]) if row["messages"] else [{"role": "user", "content": row["prompt"]}]
        prepared.append({"id": row["id"], "prompt_ids": row["prompt_ids"], "messages": messages,
                         "next_turns": json.loads(row["next_turns"]) if row["next_turns"] else [],
                         "max_new_tokens": row["max_new_tokens"] or config.max_new_tokens})
    return prepared


def run_hf_peer(config: BenchmarkConfig, requests: Path, ar_outputs: dict[str, list[int]]) -> list[dict]:
    """HF greedy generate at each batch size on the same requests, in this process with every CPU thread."""
    import torch

    from pipelines.hf_batch_peer import run_peer  # lazy: torch, for the HF peer only
    from specdec_core.model.model_runner import ModelRunner  # lazy: torch, for the HF peer only

    torch.set_num_threads(os.cpu_count() or 1)
    runner = ModelRunner.load(config.model, config.dtype)
    prepared = prepared_requests(config, requests)
    run_peer(runner, prepared[:1], 1)  # warm-up: first-call allocations are not the peer's throughput
    results = []
    for batch_size in config.hf_batch_sizes:
        result = run_peer(runner, prepared, batch_size)
        outputs = result.pop("outputs")
        same = sum(outputs[k] == ar_outputs.get(k) for k in outputs)
        results.append({**result, "same_as_ar": same, "requests": len(outputs)})
    return results


def ar_outputs(output: str, run_id: str) -> dict[str, list[int]]:
    rows = _select(output, "SELECT request_id, output_token_ids FROM generations WHERE run_id = $run "
                           "AND method = 'ar' AND error IS NULL", run_id)
    return {r["request_id"]: list(r["output_token_ids"]) for r in rows}


def run_benchmark(config: BenchmarkConfig, progress=print) -> dict:
    """All runs, then the summary dict (also written to OUTPUT/benchmark/benchmark.json)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    requests = write_request_set(config)
    pipeline_runs = []
    for actors in config.actors:
        progress(f"pipeline run with {actors} decode actor(s), methods {', '.join(config.methods)} ...")
        pipeline_runs.append(run_pipeline(config, requests, actors, f"bench-{stamp}-a{actors}"))
    main_run = pipeline_runs[0]["run_id"]
    hf = []
    if config.hf_batch_sizes:
        progress(f"HF generate greedy at batch sizes {config.hf_batch_sizes} ...")
        hf = run_hf_peer(config, requests, ar_outputs(config.output, main_run))
    return {"config": config.model_dump(), "speedup_run": main_run, "pipeline_runs": pipeline_runs,
            "methods_in_speedup_run": method_throughput(config.output, main_run), "hf_generate": hf}
