"""Attention weights of a few chosen heads, without eager attention.

SDPA (and flash attention) never materialise attention maps, and running the whole model eagerly to get them would
cost every row every step. PLD+ (a) needs the weights of ~50 heads for ONE query per row per step, so this module
recomputes just those: a pre-hook on each chosen layer's attention module projects the queries of the chosen heads
from the module's own input (its q_proj, q_norm if any, and the rotary embedding the model passed in), and the
weights are then softmax(q · K / √d) against the keys already in the engine's cache, which hold exactly the
(post-rotary) keys the real attention used.

Works for the attention modules of Llama, Qwen2, Gemma3 (q_norm, query_pre_attn_scalar via `scaling`) and others
that follow transformers' layout (q_proj, head_dim, scaling, num_key_value_groups, apply_rotary_pos_emb in the
modeling module); a model without it gets one clear error.
"""

from __future__ import annotations

import sys

import torch

from ..errors import SpecbatchError
from ..kernels import head_attention as compiled

Heads = dict[int, list[int]]  # layer index (0-based decoder layer) -> query head indices


class AttentionProbeError(SpecbatchError):
    pass


def attention_module(runner, layer: int):
    module = runner.base_model.layers[layer].self_attn
    needed = ("q_proj", "head_dim", "scaling", "num_key_value_groups")
    if not all(hasattr(module, name) for name in needed) or _rotary(module) is None:
        raise AttentionProbeError(
            f"cannot read attention heads of {runner.name!r}: its attention module {type(module).__name__} lacks "
            "transformers' usual layout (q_proj, head_dim, scaling, rotary embedding)")
    return module


def _rotary(module):
    return getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)


def project_queries(module, hidden: torch.Tensor, position_embeddings, heads: list[int]) -> torch.Tensor:
    """[b, T, hidden] (the attention module's input) -> [b, len(heads), T, head_dim] float32 post-rotary queries."""
    d = module.head_dim
    weight = module.q_proj.weight.view(-1, d, module.q_proj.weight.shape[1])[heads]  # [n, d, hidden]
    q = torch.einsum("bth,ndh->bntd", hidden, weight)  # [b, n, T, d]
    if module.q_proj.bias is not None:
        q = q + module.q_proj.bias.view(-1, d)[heads][None, :, None, :]
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)  # per-head RMS norm over head_dim (Gemma3, Qwen3)
    cos, sin = position_embeddings
    q, _ = _rotary(module)(q, q, cos, sin)
    return q.float()


def capture_queries(runner, heads: Heads, captured: dict) -> list:
    """Register pre-hooks that store captured[layer] = [b, n_heads, T, d] queries of `heads` during the next forward;
    returns the hook handles (remove them after the forward)."""
    hooks = []
    for layer, head_ids in heads.items():
        module = attention_module(runner, layer)

        def store(module, args, kwargs, layer=layer, head_ids=head_ids):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured[layer] = project_queries(module, hidden, kwargs["position_embeddings"], head_ids)

        hooks.append(module.register_forward_pre_hook(store, with_kwargs=True))
    return hooks


def head_attention(runner, keys_by_layer, queries: dict[int, torch.Tensor], heads: Heads, length: int,
                   position: int) -> torch.Tensor:
    """Max over the chosen heads of their attention weights from one query over keys 0..length-1 -> [length].

    keys_by_layer[layer]: [kv_heads, >= length, d] this row's cached keys; queries[layer]: [n_heads, d] its query,
    at `position` (sliding-window layers see only the last `window` positions, as the model does).
    """
    best = torch.zeros(length)
    for layer, query in queries.items():
        module = attention_module(runner, layer)
        kv_heads = [h // module.num_key_value_groups for h in heads[layer]]
        keys = keys_by_layer[layer][kv_heads, :length].float()  # [n, L, d]
        scores = torch.einsum("nd,nld->nl", query, keys) * module.scaling  # [n, L]
        window = attention_window(runner, layer)
        if window is not None:
            scores[:, : max(0, position - window + 1)] = float("-inf")
        best = torch.maximum(best, torch.softmax(scores, dim=-1).amax(dim=0).cpu())
    return best


def rows_attention(runner, key_cache: list[torch.Tensor], rows: list[int], lengths: list[int], heads: Heads,
                   queries: dict[int, torch.Tensor]) -> torch.Tensor:
    """head_attention for R rows at once, each from its query at position length - 1 over its keys 0..length-1: one
    compiled pass over every row and layer where the cache is a CPU tensor (kernels/head_attention.py), else
    head_attention a row at a time.

    key_cache[layer] [slots, KV, capacity, d]; rows / lengths [R] cache rows and key counts; heads: one set for all
    rows; queries[layer] [R, len(heads[layer]), d] float32 -> [R, max(lengths)] float32 (row r up to lengths[r]).
    """
    out = torch.zeros(len(rows), max(lengths, default=0))  # [R, L]
    layers = sorted(heads)
    if not rows or not layers:
        return out
    if not compiled.usable(key_cache[layers[0]]):
        for r, (row, length) in enumerate(zip(rows, lengths)):
            out[r, :length] = head_attention(runner, {layer: key_cache[layer][row] for layer in layers},
                                             {layer: queries[layer][r] for layer in layers}, heads, length,
                                             length - 1)
        return out
    modules = [attention_module(runner, layer) for layer in layers]
    most = max(len(heads[layer]) for layer in layers)
    stacked = torch.zeros(len(layers), len(rows), most, modules[0].head_dim)  # [Y, R, n, d]
    wanted = torch.zeros(len(layers), len(rows), most, dtype=torch.bool)  # [Y, R, n]
    kv_of_head = [[0] * most for _ in layers]  # [Y, n]
    starts = []  # [Y, R]
    for y, (layer, module) in enumerate(zip(layers, modules)):
        count = len(heads[layer])
        stacked[y, :, :count] = queries[layer]
        wanted[y, :, :count] = True
        kv_of_head[y][:count] = [h // module.num_key_value_groups for h in heads[layer]]
        window = attention_window(runner, layer)
        starts.append([0 if window is None else max(0, length - window) for length in lengths])
    compiled.most_attention([key_cache[layer] for layer in layers], rows, lengths, starts, stacked, kv_of_head,
                            wanted, [module.scaling for module in modules], out)
    return out


def attention_window(runner, layer: int) -> int | None:
    config = runner.model.config
    types = getattr(config, "layer_types", None)
    if types and types[layer] == "sliding_attention":
        return config.sliding_window
    return None
