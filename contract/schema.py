"""The output contract as pyarrow schemas: generations (one row per request x method) and runs (one per run)."""

from __future__ import annotations

import pyarrow as pa

GENERATIONS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("job", pa.string()),
    ("request_id", pa.string()),
    ("method", pa.string()),
    ("model", pa.string()),
    ("drafter", pa.string()),
    ("dtype", pa.string()),
    ("device", pa.string()),
    ("temperature", pa.float64()),
    ("seed", pa.int64()),
    ("prompt_tokens", pa.int64()),
    ("new_tokens", pa.int64()),
    ("output_text", pa.string()),
    ("output_token_ids", pa.list_(pa.int32())),
    ("finish_reason", pa.string()),
    ("target_forwards", pa.int64()),
    ("drafted_tokens", pa.int64()),
    ("accepted_tokens", pa.int64()),
    ("mean_accepted_length", pa.float64()),
    ("acceptance_rate", pa.float64()),
    ("copied_tokens", pa.int64()),
    ("accepted_by_source", pa.map_(pa.string(), pa.int64())),
    ("ttft_s", pa.float64()),
    ("tpot_s", pa.float64()),
    ("wall_s", pa.float64()),
    ("tokens_per_s", pa.float64()),
    ("lossy", pa.bool_()),
    ("error", pa.string()),
    ("host", pa.string()),
    ("actor_id", pa.string()),
    ("started_at", pa.timestamp("us", tz="UTC")),
    # Additions to the contract: the workload's task and, for multi-turn rows, the turn (1-based); the output's
    # quality against the row's `reference` (metric name + value); for edits, a unified diff against the input.
    ("task", pa.string()),
    ("turn", pa.int64()),
    ("quality_metric", pa.string()),
    ("quality", pa.float64()),
    ("diff", pa.string()),
    # Batched decoding: the decoder pass (one method over one actor call's rows) a row was decoded in, that pass's
    # wall time, mean live rows per step and peak KV-cache bytes. Repeated on each row of the pass; the runs row
    # aggregates them per method (job throughput = new tokens / decode wall time).
    ("decode_pass", pa.string()),
    ("pass_wall_s", pa.float64()),
    # Of pass_wall_s, the seconds in prompts' prefill forwards (the rest is decoding: steps, drafting, verifying).
    ("pass_prefill_s", pa.float64()),
    ("pass_mean_occupancy", pa.float64()),
    ("pass_peak_kv_bytes", pa.int64()),
    # The pass's prompt tokens, and how many of them the prefix cache supplied instead of a forward.
    ("pass_prompt_tokens", pa.int64()),
    ("pass_prefix_hit_tokens", pa.int64()),
    # The actor's job memory for the method (suffix, auto) at the pass's end, in output tokens; null without one.
    ("pass_memory_tokens", pa.int64()),
    ("batch_size", pa.int64()),
    # Whether --deterministic was on for this row (auto resolves per machine): every token's numbers independent of
    # its batch and step, so a lossless method's tokens equal ar's in bf16 too.
    ("deterministic", pa.bool_()),
    # Hash of what determines this row's output besides the request: method, model, drafter, dtype asked for,
    # sampling and decoding parameters, prompt options. --resume skips a pair only when its key is unchanged.
    ("decode_key", pa.string()),
    # The Ray node whose actor decoded the row (null outside Ray): `host` names the machine, which several nodes
    # may share.
    ("node_id", pa.string()),
    # The decode actor's warm-up before its first timed pass (warm_up.py: kernels compiled or loaded, the first
    # forwards run), in seconds; in no pass's wall time. Null where the stage did not warm up.
    ("actor_warmup_s", pa.float64()),
    # The decode actor's kernel plan for the target's linears (kernel_plan.py: which kernel at which row counts,
    # null where none is followed), and the seconds spent timing it at the model's load (0: read from the cache);
    # in neither the warm-up nor any pass's wall time.
    ("kernel_plan", pa.string()),
    ("kernel_plan_s", pa.float64()),
    # Of pass_wall_s, the seconds spent capturing graph-ready steps (a GPU's CUDA graphs, one per step shape:
    # specdec_core/model/graph_step.py); 0 where no step was captured.
    ("pass_capture_s", pa.float64()),
])

METHOD_STATS = pa.struct([
    ("method", pa.string()),
    ("requests", pa.int64()),
    ("errors", pa.int64()),
    ("new_tokens", pa.int64()),
    ("decode_wall_s", pa.float64()),
    ("job_tokens_per_s", pa.float64()),
    # decode_wall_s = prefill_s + decode_s (+ capture_s on a GPU): the passes' prefill forwards, and the rest (all of
    # speculation's work).
    ("prefill_s", pa.float64()),
    ("decode_s", pa.float64()),
    ("prefill_tokens_per_s", pa.float64()),  # prompt tokens prefilled (prefix hits excluded) / prefill_s
    ("decode_tokens_per_s", pa.float64()),  # new tokens / decode_s
    ("mean_occupancy", pa.float64()),
    ("drafted_tokens", pa.int64()),
    ("accepted_tokens", pa.int64()),
    ("peak_kv_bytes", pa.int64()),
    ("actors", pa.int64()),
    ("prefix_hit_rate", pa.float64()),  # prompt tokens supplied by the prefix cache / prompt tokens
    ("memory_tokens", pa.int64()),  # the largest job memory a pass of the method ended with (null: none)
    ("memory_accepted_share", pa.float64()),  # accepted draft tokens drafted from the job memory / accepted tokens
    ("capture_s", pa.float64()),  # of decode_wall_s, the passes' graph captures (pass_capture_s): not in decode_s
])

RUNS_SCHEMA = pa.schema([
    ("run_id", pa.string()),
    ("job", pa.string()),
    ("config", pa.string()),  # JSON
    ("versions", pa.string()),  # JSON
    ("hardware", pa.string()),  # JSON
    ("started_at", pa.timestamp("us", tz="UTC")),
    ("ended_at", pa.timestamp("us", tz="UTC")),
    ("rows_in", pa.int64()),
    ("rows_out", pa.int64()),
    ("errors", pa.int64()),
    # Per method of the run (batched decoding): decode_wall_s = the method's decoder passes' wall time summed,
    # divided by the actors that ran them; job_tokens_per_s = new_tokens / decode_wall_s.
    ("method_stats", pa.list_(METHOD_STATS)),
    # The longest decode actor warm-up of the run (seconds before an actor's first timed pass; warm_up.py).
    ("warmup_s", pa.float64()),
])

PARTITION_COLUMNS = ["run_id", "method"]


def generations_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts) -> a table with exactly the contract's columns and types; missing values become null."""
    columns = {field.name: [row.get(field.name) for row in rows] for field in GENERATIONS_SCHEMA}
    columns["accepted_by_source"] = [list((d or {}).items()) for d in columns["accepted_by_source"]]
    return pa.Table.from_pydict(columns, schema=GENERATIONS_SCHEMA)
