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


def attention_window(runner, layer: int) -> int | None:
    config = runner.model.config
    types = getattr(config, "layer_types", None)
    if types and types[layer] == "sliding_attention":
        return config.sliding_window
    return None
