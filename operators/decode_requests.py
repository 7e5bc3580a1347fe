"""Decode stage: an actor loads the model once and decodes the rows Ray Data gives it with continuous batching.

For each method, the call's rows go through one batched decoder pass (`--batch-size` sequences at once; rows flow
into slots as others finish), so each method has its own decode wall time. Each (request, method) gives one output
row in the contract's schema, an error row when decoding it failed, so no row is ever lost. Multi-turn rows decode
their later turns with the same method, each turn's history holding the previous turns' outputs: a turn joins the
running batch as soon as the turn before it finishes.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone

from contract.decode_config import DecodeConfig
from contract.schema import generations_table
from specdec_core.errors import BadRequestError
from specdec_core.methods import METHODS

from .crash_journal import BATCH_ATTEMPTS, batch_key
from .hang_watchdog import HangWatchdog
from .score_outputs import output_annotations


class DecodeRequests:
    def __init__(self, config: dict, torch_threads: int, journal=None):
        """journal: the run's CrashJournal actor (crash_journal.py); None decodes without poison-row isolation."""
        import torch
        from transformers.utils import logging as transformers_logging

        from specdec_core.engine import Engine, EngineConfig  # lazy: torch, in the actor only

        # Ray sets OMP_NUM_THREADS=1 in actors; use the CPUs this actor was given instead.
        torch.set_num_threads(max(1, torch_threads))
        transformers_logging.disable_progress_bar()  # actor output goes to the job's log: no weight-loading bars
        cfg = DecodeConfig.model_validate(config)
        engine = Engine(EngineConfig(cfg.model, cfg.dtype, cfg.device, cfg.drafter, cfg.drafter_dtype,
                                     deterministic=cfg.deterministic, memory_tokens=cfg.memory_tokens,
                                     memory_from=cfg.memory_from))
        self._attach(engine, cfg, journal)
        self.warm_up()

    def warm_up(self) -> None:
        """Compile (or load) every kernel the job's methods use and run the process's first forwards before the
        first timed pass; its seconds go on each row this actor decodes (`actor_warmup_s`). Then freeze the heap:
        the actor keeps its engine to the end, and its loop's full collections skip what loading made."""
        import logging

        from specdec_core.warm_up import freeze_heap, warm_up  # lazy: torch, in the actor only

        cfg = self.config
        try:
            self.warmup_s = warm_up(self.engine, cfg.methods, cfg.batch_size, cfg.method_options)
        except Exception as exc:  # a warm-up that fails costs the figures their warm start, never the job its rows
            logging.getLogger(__name__).warning("warm-up failed (%s: %s); the first pass is timed cold",
                                                type(exc).__name__, exc)
            self.engine.forget()
        freeze_heap()

    @classmethod
    def on_engine(cls, engine, config, journal=None) -> "DecodeRequests":
        """The stage on an engine already loaded (the tests share one per session); config: a DecodeConfig."""
        stage = cls.__new__(cls)
        stage._attach(engine, config, journal)
        return stage

    def _attach(self, engine, config, journal) -> None:
        self.engine, self.config, self.journal = engine, config, journal
        self.host = socket.gethostname()
        self.actor_id, self.node_id = _ray_ids()
        # In a Ray job (a journal to count crashes) a hung forward ends this actor's process: see hang_watchdog.py.
        self.watchdog = HangWatchdog(config.hang_timeout_s) if journal is not None else None
        self.warmup_s: float | None = None  # warm_up(), when this stage ran it
        plan = engine.target.kernel_plan
        self.kernel_plan = {"kernel_plan": engine.target.kernel_plan_text(),
                            "kernel_plan_s": None if plan is None else plan.seconds}

    def _params(self, max_new_tokens: int | None):
        from specdec_core.loop.requests import DecodeParams  # lazy: torch, in the actor only
        from specdec_core.loop.sampling import SamplingParams  # lazy: torch, in the actor only

        cfg = self.config
        sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
        # The job's --max-new-tokens is a cap the operator sets (time, memory): a row may ask for fewer, never more.
        limit = min(int(max_new_tokens), cfg.max_new_tokens) if max_new_tokens else cfg.max_new_tokens
        return DecodeParams(max_new_tokens=limit, sampling=sampling)

    def _base(self, row: dict, method: str, turn: int | None) -> dict:
        cfg = self.config
        spec = METHODS[method]
        request_id = row["id"] if turn is None else f"{row['id']}#t{turn}"
        return {
            "run_id": cfg.run_id, "job": cfg.job, "request_id": request_id, "method": method, "model": cfg.model,
            "drafter": cfg.drafter if spec.needs_draft_model else None, "dtype": self.engine.target.dtype_name,
            "device": self.engine.target.device, "temperature": cfg.temperature, "seed": cfg.seed,
            "prompt_tokens": row.get("prompt_tokens"), "lossy": not spec.lossless, "host": self.host,
            "actor_id": self.actor_id, "started_at": datetime.now(timezone.utc), "task": row.get("task"),
            "turn": turn, "batch_size": cfg.batch_size, "deterministic": self.engine.target.deterministic,
            "decode_key": cfg.decode_keys.get(method), "node_id": self.node_id, "actor_warmup_s": self.warmup_s,
            **self.kernel_plan,
        }

    def _error_rows(self, row: dict, method: str, error: str, first_turn: int = 1) -> list[dict]:
        """Error rows for turns first_turn.. of a row: a turn that fails takes every later turn with it, and each
        still gets its row (resume counts a multi-turn request done by its last turn)."""
        turns = 1 + len(json.loads(row["next_turns"]) if row.get("next_turns") else [])
        if turns == 1:
            return [{**self._base(row, method, None), "error": error}]
        return [{**self._base(row, method, turn), "error": error if turn == first_turn else
                 f"turn {first_turn} failed, so this turn was not decoded: {error}"}
                for turn in range(first_turn, turns + 1)]

    def _decode_method(self, rows: list[dict], method: str) -> list[dict]:
        """One batched decoder pass of `method` over the call's rows (later turns join as earlier ones finish)."""
        run = _MethodPass(self, method)
        with self.watchdog.watching(run.decoder) if self.watchdog is not None else nullcontext():
            run.submit_first_turns(rows)
            for key, result in self.engine.results(run.decoder, method):
                run.finish(key, result)
        return run.rows()

    def _decode_all(self, rows: list[dict]) -> list[dict]:
        out = []
        for method in self.config.methods:
            todo = [row for row in rows if method in _todo(row, self.config.methods)]
            if not todo:
                continue
            try:
                out.extend(self._decode_method(todo, method))
            except Exception:  # the batched pass itself failed (e.g. an allocation in a forward): row by row
                for row in todo:
                    out.extend(self._decode_alone(row, method))
        return out

    def _decode_alone(self, row: dict, method: str) -> list[dict]:
        try:
            return self._decode_method([row], method)
        except Exception as exc:
            return self._error_rows(row, method, f"{type(exc).__name__}: {exc}")

    def _decode_isolated(self, rows: list[dict], key: str) -> list[dict]:
        """This batch crashed its workers BATCH_ATTEMPTS times: decode it one (request, method) at a time, and give
        the unit that crashed a worker error rows instead of a third try (crash_journal.py)."""
        import ray

        out = []
        for index, row in enumerate(rows):
            for method in _todo(row, self.config.methods):
                unit = f"{index}\t{method}"  # the batch is the same on every attempt: its row order too
                state, done_rows = ray.get(self.journal.begin_unit.remote(key, unit))
                if state == "done":
                    out.extend(done_rows)
                    continue
                if state == "crashed":
                    unit_rows = self._error_rows(row, method, (
                        "decoding crashed the worker: its process died while decoding this row, alone, after its "
                        f"batch had crashed {BATCH_ATTEMPTS} times (out of memory, a native crash, or a forward that "
                        "hung until the hang watchdog ended it)"))
                else:
                    unit_rows = self._decode_alone(row, method)
                ray.get(self.journal.finish_unit.remote(key, unit, unit_rows))
                out.extend(unit_rows)
        return out

    def __call__(self, batch):
        import ray


        rows = [_plain_row(row) for row in batch.to_dict("records")]
        if self.journal is None:
            return generations_table(self._decode_all(rows))
        key = batch_key(rows, self.config.methods)
        crashes = ray.get(self.journal.begin_batch.remote(key))
        out = self._decode_all(rows) if crashes < BATCH_ATTEMPTS else self._decode_isolated(rows, key)
        ray.get(self.journal.end_batch.remote(key))
        return generations_table(out)


def _plain_row(record: dict) -> dict:
    """A pandas record -> the row the decode passes read: NaN -> None, and the token-id columns (numpy int32 arrays
    from the Arrow block) -> lists of int, once per call rather than once per method and turn (a context may hold
    a million ids)."""
    row = {k: (None if isinstance(v, float) and v != v else v) for k, v in record.items()}
    for name in ("prompt_ids", "context_ids"):
        if row.get(name) is not None:
            row[name] = row[name].tolist() if hasattr(row[name], "tolist") else [int(t) for t in row[name]]
    return row


@dataclass
class _Turn:
    """A submitted turn of a request: its row, its number (1 = the prompt), the chat so far and the turns after it."""

    row: dict
    turn: int
    messages: list[dict]
    later: list[str]
    prompt_ids: list[int]


class _MethodPass:
    """One decoder pass of a method over a call's rows: first turns are submitted up front, each later turn when the
    turn before it finishes, its history holding that turn's output. Every turn ends as an output or an error row."""

    def __init__(self, stage: DecodeRequests, method: str):
        cfg = stage.config
        self.stage, self.method, self.engine = stage, method, stage.engine
        self.decoder = self.engine.decoder(cfg.batch_size, cfg.token_budget, cfg.speculation_budget,
                                           cfg.row_timeout_s, method=method)
        self.turns: dict[int, _Turn] = {}  # decoder key -> its turn, until its result comes
        self.next_key = 0
        self.out: list[dict] = []

    def submit(self, turn: _Turn) -> None:
        from specdec_core.engine import BatchItem  # lazy: torch, in the actor only

        item = BatchItem(self.next_key, turn.prompt_ids, self.stage._params(turn.row.get("max_new_tokens")),
                         turn.row.get("context_ids"))
        request = self.engine.request(item, self.method, self.stage.config.method_options, self.decoder)
        request.turns_after = len(turn.later)  # the budget's tail rule: this row's chain goes on after it ends
        self.decoder.submit(request)
        self.turns[self.next_key] = turn
        self.next_key += 1

    def submit_first_turns(self, rows: list[dict]) -> None:
        for row in rows:
            if row.get("input_error"):
                self.out.extend(self.stage._error_rows(row, self.method, row["input_error"]))
                continue
            try:
                later = json.loads(row["next_turns"]) if row.get("next_turns") else []
                messages = json.loads(row["messages"]) if row.get("messages") else [
                    {"role": "user", "content": row["prompt"]}]
                self.submit(_Turn(row, 1, messages, later, row["prompt_ids"]))
            except Exception as exc:  # one malformed row errors alone
                self.out.extend(self.stage._error_rows(row, self.method, f"{type(exc).__name__}: {exc}"))

    def finish(self, key: int, result: dict) -> None:
        """A turn's result -> its output row (or error row, which takes the later turns with it); the next turn."""
        entry = self.turns.pop(key)
        row, turn, later = entry.row, entry.turn, entry.later
        base = self.stage._base(row, self.method, turn if later or turn > 1 else None)
        if result["error"]:
            self.out.append({**base, "prompt_tokens": len(entry.prompt_ids), "error": result["error"]})
            if later:
                self.out.extend(self.stage._error_rows(row, self.method, result["error"], turn)[1:])
            return
        try:
            annotations, error = output_annotations(row, result["output_text"]), None
        except Exception as exc:  # the output stays; the row says why it has no score
            annotations, error = {}, f"scoring the output failed: {type(exc).__name__}: {exc}"
        self.out.append({**base, **_contract_fields(result), **annotations, "prompt_tokens": len(entry.prompt_ids),
                         "error": error})
        if later:
            self._submit_next_turn(entry, result["output_text"])

    def _submit_next_turn(self, entry: _Turn, answer: str) -> None:
        limit = self.stage.config.max_prompt_tokens
        messages = entry.messages + [{"role": "assistant", "content": answer},
                                     {"role": "user", "content": entry.later[0]}]
        try:
            prompt_ids = self.engine.prompt_ids(messages=messages)
            if limit and len(prompt_ids) > limit:
                raise BadRequestError(f"prompt has {len(prompt_ids)} tokens, over the limit of {limit} "
                                      "(--max-prompt-tokens)")
            self.submit(_Turn(entry.row, entry.turn + 1, messages, entry.later[1:], prompt_ids))
        except Exception as exc:
            self.out.extend(self.stage._error_rows(entry.row, self.method, f"{type(exc).__name__}: {exc}",
                                                   entry.turn + 1))

    def rows(self) -> list[dict]:
        """The pass's rows, each with the pass's own figures."""
        stats, memory = self.decoder.stats, self.decoder.job_memory
        pass_fields = {"decode_pass": f"{self.stage.actor_id}:{uuid.uuid4().hex[:8]}", "pass_wall_s": stats.wall_s,
                       "pass_prefill_s": stats.prefill_s, "pass_capture_s": stats.capture_s, "pass_mean_occupancy": stats.mean_occupancy, "pass_peak_kv_bytes": stats.peak_cache_bytes,
                       "pass_prompt_tokens": stats.prompt_tokens, "pass_prefix_hit_tokens": stats.prefix_hit_tokens,
                       "pass_memory_tokens": memory.tokens if memory is not None else None}
        return [{**r, **pass_fields} for r in self.out]


def _todo(row: dict, methods: list[str]) -> list[str]:
    """--resume: the reader stage listed the methods each request still needs (operators/skip_done.py)."""
    return methods if row.get("todo_methods") is None else [m for m in methods if m in list(row["todo_methods"])]


CONTRACT_RESULT_KEYS = (
    "new_tokens", "output_text", "output_token_ids", "finish_reason", "target_forwards", "drafted_tokens",
    "accepted_tokens", "mean_accepted_length", "acceptance_rate", "copied_tokens", "accepted_by_source", "ttft_s",
    "tpot_s", "wall_s", "tokens_per_s",
)


def _contract_fields(result: dict) -> dict:
    return {key: result[key] for key in CONTRACT_RESULT_KEYS}


def _ray_ids() -> tuple[str, str | None]:
    """(the Ray actor's id, its node's id), or (the process id, None) outside Ray: the runtime context would start a
    Ray of its own there."""
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            return context.get_actor_id() or f"pid-{os.getpid()}", context.get_node_id()
    except Exception:
        pass
    return f"pid-{os.getpid()}", None
