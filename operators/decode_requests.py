"""Decode stage: an actor loads the model once and runs every requested method on each request.

Each (request, method) gives one output row in the contract's schema, an error row when decoding it failed, so no
row is ever lost. Multi-turn rows decode their later turns after the first, with the same method, each turn's
history holding the previous turns' outputs, and give one output row per turn.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timezone

from .score_outputs import output_annotations


class DecodeRequests:
    def __init__(self, config: dict, torch_threads: int, done: frozenset = frozenset()):
        import torch

        from pipelines.config import GenerationConfig
        from specdec_core.engine import Engine, EngineConfig

        # Ray sets OMP_NUM_THREADS=1 in actors; use the CPUs this actor was given instead.
        torch.set_num_threads(max(1, torch_threads))
        self.config = GenerationConfig.model_validate(config)
        cfg = self.config
        self.engine = Engine(EngineConfig(cfg.model, cfg.dtype, cfg.device, cfg.drafter, cfg.drafter_dtype))
        self.done = done  # "request_id\tmethod" pairs already in the output (--resume)
        self.host = socket.gethostname()
        self.actor_id = _actor_id()

    def _params(self, max_new_tokens: int | None):
        from specdec_core.decode import DecodeParams
        from specdec_core.sampling import SamplingParams

        cfg = self.config
        sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed)
        return DecodeParams(max_new_tokens=max_new_tokens or cfg.max_new_tokens, sampling=sampling)

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
            "turn": turn,
        }

    def _decode_turns(self, row: dict, method: str, context_ids: list[int] | None) -> list[dict]:
        later_turns = json.loads(row["next_turns"]) if row.get("next_turns") else []
        multi = bool(later_turns)
        params = self._params(row.get("max_new_tokens"))
        out = []
        base = self._base(row, method, 1 if multi else None)
        if row.get("input_error"):
            return [{**base, "error": row["input_error"]}]
        prompt_ids = [int(t) for t in row["prompt_ids"]]  # numpy int32 from the Arrow block -> int
        messages = json.loads(row["messages"]) if row.get("messages") else [{"role": "user", "content": row["prompt"]}]
        for turn in range(1, len(later_turns) + 2):
            base = self._base(row, method, turn if multi else None)
            try:
                result = self.engine.generate_ids(prompt_ids, method, params, self.config.method_options,
                                                  context_ids)
            except Exception as exc:  # one failing request must not stop the job
                out.append({**base, "prompt_tokens": len(prompt_ids), "error": f"{type(exc).__name__}: {exc}"})
                break
            out.append({**base, **_contract_fields(result), **output_annotations(row, result["output_text"]),
                        "prompt_tokens": len(prompt_ids), "error": None})
            if turn <= len(later_turns):
                messages = messages + [{"role": "assistant", "content": result["output_text"]},
                                       {"role": "user", "content": later_turns[turn - 1]}]
                try:
                    prompt_ids = self.engine.prompt_ids(messages=messages)
                except Exception as exc:
                    out.append({**self._base(row, method, turn + 1), "error": f"{type(exc).__name__}: {exc}"})
                    break
        return out

    def __call__(self, batch):
        from pipelines.schema import generations_table

        _maybe_die_for_test()
        rows = []
        for row in batch.to_dict("records"):
            row = {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
            # The context is tokenized once per request, for every method's drafter.
            context_ids = self.engine.tokenizer(row["context"])["input_ids"] if row.get("context") else None
            for method in self.config.methods:
                if f"{_final_request_id(row)}\t{method}" in self.done:
                    continue
                rows.extend(self._decode_turns(row, method, context_ids))
        return generations_table(rows)


CONTRACT_RESULT_KEYS = (
    "new_tokens", "output_text", "output_token_ids", "finish_reason", "target_forwards", "drafted_tokens",
    "accepted_tokens", "mean_accepted_length", "acceptance_rate", "copied_tokens", "accepted_by_source", "ttft_s",
    "tpot_s", "wall_s", "tokens_per_s",
)


def _contract_fields(result: dict) -> dict:
    return {key: result[key] for key in CONTRACT_RESULT_KEYS}


def _final_request_id(row: dict) -> str:
    """The request id of a row's last output row: a multi-turn request is done when its last turn is."""
    later_turns = json.loads(row["next_turns"]) if row.get("next_turns") else []
    return f"{row['id']}#t{len(later_turns) + 1}" if later_turns else row["id"]


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
