"""The batch-job peer: Hugging Face `generate` (greedy) over the same requests at a given batch size.

A batch job is judged on throughput, and HF greedy gains from batching (decisions.md: pipelines/hf_batch_peer.py),
so this is the number the engine's own batched decoding has to beat later. Requests are sorted by
prompt length (less padding, as a careful user would do), left-padded, and decoded with the batch's largest
max_new_tokens; each row's new tokens are counted up to its own limit or EOS (included, as in our outputs).
Multi-turn requests decode turn by turn: every later turn's history holds the previous turn's HF output.
"""

from __future__ import annotations

import time

import torch

from specdec_core.prompts import build_prompt_ids


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _new_tokens(row_ids: list[int], limit: int, eos_ids: frozenset[int]) -> list[int]:
    kept = []
    for token in row_ids[:limit]:
        kept.append(token)
        if token in eos_ids:
            break
    return kept


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids, attention_mask [batch, longest]: each prompt right-aligned, as HF's decoder-only models expect."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[i, width - len(prompt):] = 1
    return input_ids, attention_mask


def generate_batch(runner, prompts: list[list[int]], limits: list[int]) -> list[list[int]]:
    """Greedy HF generate over left-padded prompts -> each row's new token ids (up to its limit / EOS)."""
    tokenizer = runner.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(runner.eos_token_ids))
    input_ids, attention_mask = left_padded(prompts, pad_id)  # [batch, width]
    width = input_ids.shape[1]
    with torch.inference_mode():
        out = runner.model.generate(input_ids=input_ids.to(runner.device),
                                    attention_mask=attention_mask.to(runner.device), do_sample=False,
                                    max_new_tokens=max(limits), pad_token_id=pad_id)
    return [_new_tokens(out[i, width:].tolist(), limits[i], runner.eos_token_ids) for i in range(len(prompts))]


def run_peer(runner, requests: list[dict], batch_size: int) -> dict:
    """requests: {id, prompt_ids, messages, next_turns, max_new_tokens} (prompt stage output, usable rows only).

    -> {batch_size, new_tokens, wall_s, tokens_per_s, outputs: {request_id: token ids}}
    """
    outputs: dict[str, list[int]] = {}
    pending = [{"id": r["id"], "ids": list(r["prompt_ids"]), "messages": list(r["messages"]),
                "next_turns": list(r["next_turns"]), "limit": r["max_new_tokens"], "turn": 1} for r in requests]
    new_tokens = 0
    started = time.perf_counter()
    while pending:
        pending.sort(key=lambda r: len(r["ids"]))
        following = []
        for batch in _batches(pending, batch_size):
            results = generate_batch(runner, [r["ids"] for r in batch], [r["limit"] for r in batch])
            for request, ids in zip(batch, results):
                multi = bool(request["next_turns"]) or request["turn"] > 1
                outputs[f"{request['id']}#t{request['turn']}" if multi else request["id"]] = ids
                new_tokens += len(ids)
                if request["next_turns"]:
                    text = runner.tokenizer.decode(ids, skip_special_tokens=True)
                    messages = request["messages"] + [{"role": "assistant", "content": text},
                                                      {"role": "user", "content": request["next_turns"][0]}]
                    following.append({**request, "messages": messages, "next_turns": request["next_turns"][1:],
                                      "turn": request["turn"] + 1, "ids": _chat_ids(runner.tokenizer, messages)})
        pending = following
    wall = time.perf_counter() - started
    return {"batch_size": batch_size, "new_tokens": new_tokens, "wall_s": wall, "tokens_per_s": new_tokens / wall,
            "outputs": outputs}


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return build_prompt_ids(tokenizer, messages=messages)
