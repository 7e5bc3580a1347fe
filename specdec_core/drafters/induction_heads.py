"""PLD+ (a)'s one-off discovery of a model's copying ("induction") heads (paper §4.2.1), saved next to the model cache.

For a few prompts, decode greedily; for every generated token o that also occurs in the prompt, the position r* it
was most likely copied from is the prompt occurrence with the longest common suffix with the text before o. A head
scores a hit when, from the query that produced o (position of o - 1), its largest attention weight falls on r*.
Heads are ranked by hits; PLD+ (a) uses the top N (paper: 50 of Vicuna-7B's 1,024; B.1).

The attention maps come from attention_probe (queries of every head recomputed from a hooked forward, keys from the
engine's cache), so discovery, like decoding, never runs eager attention.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import textwrap
from pathlib import Path

import torch

from ..defaults import cache_root
from ..loop.batch_decode import BatchDecoder, DecodeRequest
from ..loop.kv_cache import new_slot_cache
from ..loop.requests import DecodeParams
from ..model.attention_probe import attention_module, attention_window
from ..model.step_batch import StepBatch
from ..prompts import build_prompt_ids
from .base import NoDrafter

FORMAT = 2  # 2: prompts from the standard library
DISCOVERY_NEW_TOKENS = 64
MAX_SUFFIX = 32  # longest common suffix looked at when choosing r*
DOC_MODULES = ("json", "argparse", "csv", "statistics", "uuid", "heapq", "pydoc", "sched")  # long prose docstrings
CODE_MODULES = ("textwrap", "shlex", "difflib", "calendar", "configparser", "gettext", "pprint", "tokenize")


def heads_file(model_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(model_name)).strip("_") or "model"
    return cache_root() / "induction_heads" / f"{safe}.json"


def discovery_prompts(tokenizer, count: int = 8) -> list[list[int]]:
    """Copy-heavy prompts built from the Python standard library, so that discovery needs no data package: half ask
    for a summary of a module's documentation, half for one of a module's functions again without its comments."""
    summaries = [f"Summarize this documentation in a few sentences.\n\n{_module_doc(name)}" for name in DOC_MODULES]
    edits = [f"Output this Python function again with its comments removed, and nothing else.\n\n```python\n"
             f"{source}```" for source in filter(None, map(_first_function_source, CODE_MODULES))]
    half = count // 2
    prompts = summaries[:half] + edits[: count - half]
    return [build_prompt_ids(tokenizer, prompt=prompt) for prompt in prompts]


def _module_doc(name: str) -> str:
    return importlib.import_module(name).__doc__ or ""


def _first_function_source(module_name: str, min_lines: int = 30, max_lines: int = 120) -> str | None:
    """The source of the module's first function (by name) of min_lines to max_lines lines, or None."""
    module = importlib.import_module(module_name)
    for _, obj in sorted(vars(module).items()):
        if inspect.isfunction(obj) and obj.__module__ == module_name:
            try:
                source = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if min_lines <= source.count("\n") <= max_lines:
                return source
    return None


def copy_source(sequence: list[int], prompt_len: int, position: int) -> int | None:
    """r*: the prompt position holding sequence[position] whose preceding tokens match those before `position`
    longest (the earliest on ties), or None when the token is not in the prompt."""
    token = sequence[position]
    best, best_overlap = None, -1
    for r in range(prompt_len):
        if sequence[r] != token:
            continue
        overlap = 0
        while overlap < MAX_SUFFIX and r - 1 - overlap >= 0 and sequence[r - 1 - overlap] == sequence[position - 1 - overlap]:
            overlap += 1
        if overlap > best_overlap:
            best, best_overlap = r, overlap
    return best


@torch.inference_mode()
def discover(runner, prompts: list[list[int]], new_tokens: int = DISCOVERY_NEW_TOKENS) -> dict:
    """-> {"model", "format", "events", "heads": [[layer, head, hits], ...] best first}. Deterministic (greedy)."""

    config = runner.model.config
    num_heads = config.num_attention_heads
    every_head = {layer: list(range(num_heads)) for layer in range(runner.num_layers)}
    hits = torch.zeros(runner.num_layers, num_heads, dtype=torch.long)
    decoder = BatchDecoder(runner, max_batch=len(prompts))
    for index, prompt in enumerate(prompts):
        decoder.submit(DecodeRequest(index, prompt, DecodeParams(max_new_tokens=new_tokens), NoDrafter()))
    outputs = {request.key: result for request, result in decoder.run()}
    events = 0
    for index, prompt in enumerate(prompts):
        if isinstance(outputs[index], str):
            continue  # a prompt that could not be decoded teaches nothing
        sequence = list(prompt) + outputs[index].token_ids
        cache = new_slot_cache(runner)
        cache.fit(1, len(sequence))
        row = cache.add_row()
        queries: dict[int, torch.Tensor] = {}
        size = len(sequence)
        runner.forward_slots(cache, StepBatch(torch.tensor([sequence]), torch.arange(size)[None],
                                              torch.ones(size, size, dtype=torch.bool).tril()[None],
                                              torch.tensor([[0, size - 1]]), rows=[row], query_heads=every_head,
                                              queries=queries))
        positions = [p for p in range(len(prompt), len(sequence))]
        sources = [copy_source(sequence, len(prompt), p) for p in positions]
        events_here = [(p - 1, r) for p, r in zip(positions, sources) if r is not None]  # (query, source)
        events += len(events_here)
        if not events_here:
            continue
        query_positions = torch.tensor([q for q, _ in events_here])  # [E]
        wanted = torch.tensor([r for _, r in events_here])  # [E]
        for layer in range(runner.num_layers):
            hits[layer] += layer_hits(runner, layer, queries[layer][0], cache.keys[layer][row], query_positions,
                                      wanted)
    ranked = sorted(((int(hits[l, h]), l, h) for l in range(runner.num_layers) for h in range(num_heads)),
                    key=lambda item: (-item[0], item[1], item[2]))
    return {"model": runner.name, "format": FORMAT, "prompts": len(prompts), "new_tokens": new_tokens,
            "events": events, "heads": [[layer, head, count] for count, layer, head in ranked]}


def layer_hits(runner, layer: int, queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor,
               wanted: torch.Tensor) -> torch.Tensor:
    """[heads] how often each head's largest attention weight from query_positions[e] falls on wanted[e].

    queries [heads, S, d] (post-rotary), keys [kv_heads, >= S, d]; causal (and windowed on sliding layers).
    """
    module = attention_module(runner, layer)
    q = queries[:, query_positions]  # [H, E, d]
    k = keys.float().repeat_interleave(module.num_key_value_groups, dim=0)[:, : int(query_positions.max()) + 1]
    scores = torch.einsum("hed,hsd->hes", q, k)  # [H, E, S]; argmax needs no softmax (nor the scaling)
    key_pos = torch.arange(k.shape[1])
    hidden = key_pos[None, :] > query_positions[:, None]  # [E, S]: future keys
    window = attention_window(runner, layer)
    if window is not None:
        hidden |= key_pos[None, :] <= query_positions[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return (scores.argmax(dim=-1) == wanted[None, :]).sum(dim=1)  # [H]


def load_or_discover(runner, path: Path | None = None) -> dict:
    """The saved ranking for this model, discovered (and saved) on first use."""
    path = path or heads_file(runner.name)
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("format") == FORMAT and saved.get("model") == runner.name:
            return saved
    found = discover(runner, discovery_prompts(runner.tokenizer))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(found))
    partial.replace(path)  # atomic: a reader never sees half a file
    return found


def top_heads(ranking: dict, count: int) -> dict[int, list[int]]:
    """{layer: [heads]} of the `count` best-ranked heads that scored at least one hit."""
    chosen: dict[int, list[int]] = {}
    for layer, head, count_hits in ranking["heads"][:count]:
        if count_hits > 0:
            chosen.setdefault(layer, []).append(head)
    return chosen
