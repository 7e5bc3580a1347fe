"""The 4-D float attention masks of a slot-cache forward (SlotKVCache rows of different lengths, chains and trees)."""

from __future__ import annotations

import torch


def attention_masks(config, lengths, positions, visible, kv_len: int, dtype: torch.dtype):
    """4-D float masks [b, 1, T, kv_len] (0 = may attend, dtype-min = may not) for a slot-cache forward.

    Row r's key j is: a cached token when j < lengths[r] (position j), new token i = j - lengths[r] when
    0 <= i < T (position positions[r, i]), else dead (padding, rolled-back drafts). Worked example, lengths [3, 1],
    T = 2, chain: row 0 query t=1 sees keys 0,1,2 (cache) and 3,4 (new tokens 0,1); row 1 query t=0 sees key 0 and
    key 1 (itself), never keys 2..4, which are row 1's padding.
    A model with sliding-window layers gets a dict {layer type: mask}, the windowed one also requiring
    query position - key position < window, as the model's own masks do.
    """
    b, num_new = positions.shape
    device = lengths.device  # built where lengths, positions and visible are (the forward's device)
    allowed = visible_keys(lengths, visible, kv_len)  # [b, T, L]
    minimum = torch.finfo(dtype).min
    layer_types = getattr(config, "layer_types", None)
    full = torch.zeros(b, 1, num_new, kv_len, dtype=dtype, device=device).masked_fill(~allowed[:, None], minimum)
    if not layer_types:
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        return full if not window else _windowed(allowed, lengths, positions, kv_len, window, dtype)
    masks = {"full_attention": full}
    if "sliding_attention" in layer_types:
        masks["sliding_attention"] = _windowed(allowed, lengths, positions, kv_len, config.sliding_window, dtype)
    return masks


def visible_keys(lengths: torch.Tensor, visible: torch.Tensor, kv_len: int) -> torch.Tensor:
    """lengths [b], visible [b, T, T] -> [b, T, kv_len] bool: key j of row r is a cached token when j < lengths[r],
    new token i = j - lengths[r] when 0 <= i < T (seen as visible[r, t, i] says), else dead."""
    b, num_new, _ = visible.shape
    key = torch.arange(kv_len, device=lengths.device)[None, :]  # [1, L]
    new_index = key - lengths[:, None]  # [b, L]: which new token a key is, if 0 <= . < T
    is_cached = new_index < 0  # [b, L]
    is_new = (new_index >= 0) & (new_index < num_new)
    gathered = visible.gather(2, new_index.clamp(0, num_new - 1)[:, None, :].expand(b, num_new, kv_len))  # [b,T,L]
    return is_cached[:, None, :] | (gathered & is_new[:, None, :])


def _windowed(allowed, lengths, positions, kv_len: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    b, num_new = positions.shape
    key = torch.arange(kv_len, device=lengths.device)[None, :]  # [1, L]
    new_index = (key - lengths[:, None]).clamp(0, num_new - 1)  # [b, L]
    key_pos = torch.where(key < lengths[:, None], key, positions.gather(1, new_index))  # [b, L]
    near = (positions[:, :, None] - key_pos[:, None, :]) < window  # [b, T, L]
    ok = allowed & near
    return torch.zeros(b, 1, num_new, kv_len, dtype=dtype, device=lengths.device).masked_fill(
        ~ok[:, None], torch.finfo(dtype).min)
