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
from datetime import datetime, timezone

from .score_outputs import output_annotations


class DecodeRequests:
    def __init__(self, config: dict, torch_threads: int):
        import torch

        from contract.decode_config import DecodeConfig
        from specdec_core.engine import Engine, EngineConfig

        # Ray sets OMP_NUM_THREADS=1 in actors; use the CPUs this actor was given instead.
        torch.set_num_threads(max(1, torch_threads))
        self.config = DecodeConfig.model_validate(config)
        cfg = self.config
        self.engine = Engine(EngineConfig(cfg.model, cfg.dtype, cfg.device, cfg.drafter, cfg.drafter_dtype))
        self.host = socket.gethostname()
        self.actor_id = _actor_id()

    def _params(self, max_new_tokens: int | None):
        from specdec_core.decode import DecodeParams
        from specdec_core.sampling import SamplingParams

        cfg = self.config
        sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
        # The job's --max-new-tokens is a cap the operator sets (time, memory): a row may ask for fewer, never more.
        limit = min(int(max_new_tokens), cfg.max_new_tokens) if max_new_tokens else cfg.max_new_tokens
        return DecodeParams(max_new_tokens=limit, sampling=sampling)

    def _base(self, row: dict, method: str, turn: int | None) -> dict:
        from specdec_core.methods import METHODS

        cfg = self.config
        spec = METHODS[method]
        request_id = row["id"] if turn is None else f"{row['id']}#t{turn}"
        return {
            "run_id": cfg.run_id, "job": cfg.job, "request_id": request_id, "method": method, "model": cfg.model,
            "drafter": cfg.drafter if spec.needs_draft_model else None, "dtype": self.engine.target.dtype_name,
            "device": self.engine.target.device, "temperature": cfg.temperature, "seed": cfg.seed,
            "prompt_tokens": row.get("prompt_tokens"), "lossy": not spec.lossless, "host": self.host,
            "actor_id": self.actor_id, "started_at": datetime.now(timezone.utc), "task": row.get("task"),
            "turn": turn, "batch_size": cfg.batch_size, "decode_key": cfg.decode_keys.get(method),
        }

    def _decode_method(self, rows: list[dict], method: str) -> list[dict]:
        """One batched decoder pass of `method` over the call's rows (later turns join as earlier ones finish)."""
        from specdec_core.engine import BatchItem

        cfg = self.config
        decoder = self.engine.decoder(cfg.batch_size, cfg.token_budget, cfg.speculation_budget)
        out: list[dict] = []
        turns: dict[int, dict] = {}  # key -> {row, turn, messages, later}

        def submit(key: int, row: dict, turn: int, prompt_ids: list[int], messages: list[dict], later: list[str],
                   context_ids):
            turns[key] = {"row": row, "turn": turn, "messages": messages, "later": later, "prompt_ids": prompt_ids}
            item = BatchItem(key, prompt_ids, self._params(row.get("max_new_tokens")), context_ids)
            decoder.submit(self.engine.request(item, method, cfg.method_options, decoder))

        next_key = 0
        for row in rows:
            later = json.loads(row["next_turns"]) if row.get("next_turns") else []
            multi = bool(later)
            if row.get("input_error"):
                out.append({**self._base(row, method, 1 if multi else None), "error": row["input_error"]})
                continue
            messages = json.loads(row["messages"]) if row.get("messages") else [
                {"role": "user", "content": row["prompt"]}]
            prompt_ids = [int(t) for t in row["prompt_ids"]]  # numpy int32 from the Arrow block -> int
            submit(next_key, row, 1, prompt_ids, messages, later, row["_context_ids"])
            next_key += 1
        for key, result in self.engine.results(decoder, method):
            entry = turns.pop(key)
            row, turn, later = entry["row"], entry["turn"], entry["later"]
            multi = bool(later) or turn > 1
            base = self._base(row, method, turn if multi else None)
            if result["error"]:
                out.append({**base, "prompt_tokens": len(entry["prompt_ids"]), "error": result["error"]})
                continue
            out.append({**base, **_contract_fields(result), **output_annotations(row, result["output_text"]),
                        "prompt_tokens": len(entry["prompt_ids"]), "error": None})
            if later:
                messages = entry["messages"] + [{"role": "assistant", "content": result["output_text"]},
                                                {"role": "user", "content": later[0]}]
                try:
                    prompt_ids = self.engine.prompt_ids(messages=messages)
                except Exception as exc:
                    out.append({**self._base(row, method, turn + 1), "error": f"{type(exc).__name__}: {exc}"})
                    continue
                submit(next_key, row, turn + 1, prompt_ids, messages, later[1:], row["_context_ids"])
                next_key += 1
        stats = decoder.stats
        pass_fields = {"decode_pass": f"{self.actor_id}:{uuid.uuid4().hex[:8]}", "pass_wall_s": stats.wall_s,
                       "pass_mean_occupancy": stats.mean_occupancy, "pass_peak_kv_bytes": stats.peak_cache_bytes}
        return [{**r, **pass_fields} for r in out]

    def __call__(self, batch):
        from contract.schema import generations_table

        _maybe_die_for_test()
        rows = []
        for row in batch.to_dict("records"):
            row = {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
            # The context is tokenized once per request, for every method's drafter.
            row["_context_ids"] = self.engine.tokenizer(row["context"])["input_ids"] if row.get("context") else None
            rows.append(row)
        out = []
        for method in self.config.methods:
            # --resume: the reader stage listed the methods each request still needs (operators/skip_done.py).
            todo = [row for row in rows if row.get("todo_methods") is None or method in list(row["todo_methods"])]
            if todo:
                out.extend(self._decode_method(todo, method))
        return generations_table(out)


CONTRACT_RESULT_KEYS = (
    "new_tokens", "output_text", "output_token_ids", "finish_reason", "target_forwards", "drafted_tokens",
    "accepted_tokens", "mean_accepted_length", "acceptance_rate", "copied_tokens", "accepted_by_source", "ttft_s",
    "tpot_s", "wall_s", "tokens_per_s",
)


def _contract_fields(result: dict) -> dict:
    return {key: result[key] for key in CONTRACT_RESULT_KEYS}


FAULT_ENV = "SPECBATCH_TEST_KILL_ACTOR_ONCE"


def _maybe_die_for_test() -> None:
    """Fault-injection hook for the exactly-once test: when FAULT_ENV names a marker file that does not exist yet,
    create it and kill this actor process mid-job (as an OOM kill or a lost node would)."""
    marker = os.environ.get(FAULT_ENV)
    if marker and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)


def _actor_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_actor_id() or f"pid-{os.getpid()}"
    except Exception:
        return f"pid-{os.getpid()}"
