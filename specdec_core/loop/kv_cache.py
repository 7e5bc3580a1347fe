"""The engine-owned KV cache: per layer a `[slots, kv_heads, capacity, head_dim]` key and value buffer (views of one
`[2, layers, ...]` storage, so a copy across layers is one op), one row per live sequence, with per-row lengths. Rollback of a row is setting its length; what lies past it is masked out and
overwritten by the next forward (as vLLM does with rejected slots).

Layout: padded slots, not flattened ragged tokens. Stock Hugging Face attention (SDPA on CPU and GPU) takes dense
`[batch, heads, kv_len, head_dim]` keys; a flattened ragged layout would need a varlen / paged attention kernel that
those models do not have, or a gather of every row's keys into a padded tensor on every layer of every step
(the gather alone cost more than the attention it fed). With slots,
the rows of a step are the slot range [0, n) and the keys handed to attention are a *view* `buf[:n, :, :kv_len]` —
no copy. The cost is padding: each row attends over `kv_len = max(lengths) + T` keys, the shorter rows' extra keys
being masked. Attention is a small part of a small model's step (the MLPs and the LM head dominate at these
lengths), so that waste is cheaper than the gathers it saves.

Memory follows the live rows: buffers grow (and shrink) to `slots x capacity` as rows are admitted and retire, where
capacity covers the longest admitted row's prompt + max_new_tokens + one step of draft tokens. The scheduler asks
`bytes_for()` before it admits a row, and keeps the total under a budget.

Active rows are kept packed at the front (slots 0..n-1): a retiring row's slot is filled by moving the last row into
it (one row's keys, once per request), so a step never indexes scattered slots.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..model.model_runner import ModelRunner, check_servable

GROW_QUANTUM = 256  # capacity grows in steps of this many positions, so a run does not reallocate every admission


class SlotKVCache(Cache):
    """Plugs into stock HF decoder models as `past_key_values`. Call `bind(rows, num_new)` before each forward."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str | torch.device):
        # No transformers layer objects: this class overrides everything a decoder model asks of its cache.
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # committed positions of each live row (slot i = row i)
        self.storage: torch.Tensor | None = None
        self._allocate(0, 0)
        self._bound: list[int] = []  # the rows the next forward feeds
        self._contiguous = True
        self._num_new = 0
        self._kv_len = 0
        self._row_index: torch.Tensor | None = None  # [b]
        self._write_pos: torch.Tensor | None = None  # [b, T] where each new token's keys go

    # ----------------------------------------------------------------------------------------------- memory
    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def bytes_for(self, slots: int, capacity: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * slots * self.kv_heads * capacity * self.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.slots, self.capacity)

    def _allocate(self, slots: int, capacity: int) -> None:
        # One buffer for every layer's keys and values, [2, layers, slots, KV, capacity, d], each layer's a view:
        # a copy that spans the layers (a tree's accepted paths, a retiring row) is then one indexing op, not one
        # per layer and buffer (on a GPU each of those is a launch).
        old = self.storage
        self.storage = torch.zeros((2, self.num_layers, slots, self.kv_heads, capacity, self.head_dim),
                                   dtype=self.dtype, device=self.device)
        self.keys = list(self.storage[0].unbind(0))  # per layer [slots, KV, capacity, d]
        self.values = list(self.storage[1].unbind(0))
        if old is not None and self.lengths:
            n, length = len(self.lengths), min(max(self.lengths), capacity)
            self.storage[:, :, :n, :, :length] = old[:, :, :n, :, :length]

    def fit(self, slots: int, capacity: int, shrink: bool = True) -> None:
        """Make room for `slots` rows of `capacity` positions; shrink when the live rows need far less (unless not
        `shrink`: captured steps hold the buffers' addresses, and every reallocation costs their captures)."""
        capacity = -(-capacity // GROW_QUANTUM) * GROW_QUANTUM
        grow = slots > self.slots or capacity > self.capacity
        shrink = shrink and (capacity * 2 <= self.capacity or slots * 2 <= self.slots)
        if grow or shrink:
            self._allocate(max(slots, len(self.lengths)), max(capacity, max(self.lengths, default=0)))

    # ----------------------------------------------------------------------------------------------- rows
    def add_row(self) -> int:
        """A new empty row at the end of the packed rows; returns its index. Call fit() first."""
        if len(self.lengths) >= self.slots:
            raise RuntimeError("no free slot: fit() the cache before adding a row")
        self.lengths.append(0)
        return len(self.lengths) - 1

    def remove_row(self, row: int) -> int | None:
        """Free a row by moving the last row into its slot; returns the moved row's old index (None if none)."""
        last = len(self.lengths) - 1
        moved = None
        if row != last:
            length = self.lengths[last]
            self.storage[:, :, row, :, :length] = self.storage[:, :, last, :, :length]
            self.lengths[row] = length
            moved = last
        self.lengths.pop()
        return moved

    def move(self, paths: list[tuple[int, list[int], list[int]]]) -> None:
        """For each (row, source, target): copy the row's keys/values at positions `source` to `target` (a tree's
        accepted path, into place), every row and layer in one gather and one scatter. Gathered before written,
        so overlapping ranges are safe."""
        rows = [row for row, source, _ in paths for _ in source]
        if not rows:
            return
        rows = torch.tensor(rows, device=self.device)  # [M]
        src = torch.tensor([p for _, source, _ in paths for p in source], device=self.device)  # [M]
        dst = torch.tensor([p for _, _, target in paths for p in target], device=self.device)  # [M]
        # advanced indices on dims 2 and 4, a slice between: both go first, [M, 2, layers, KV, d]
        self.storage[:, :, rows, :, dst] = self.storage[:, :, rows, :, src]

    def set_length(self, row: int, length: int) -> None:
        """Commit (or roll back) a row to `length` positions; keys past it are dead and will be overwritten."""
        self.lengths[row] = length

    # ----------------------------------------------------------------------------------------------- a forward
    def bind(self, num_new: int, rows: list[int] | None = None) -> None:
        """Next forward feeds `num_new` tokens to every live row ([n, T] input), or to `rows` only ([len(rows), T]:
        a prefill, or the draft model's rows that draft this step). A contiguous range is read as a view; other
        subsets are gathered (a copy: fine for the few rows a draft model catches up)."""
        rows = list(range(len(self.lengths))) if rows is None else list(rows)
        self._bound = rows
        self._contiguous = rows == list(range(rows[0], rows[0] + len(rows))) if rows else True
        self._num_new = num_new
        self._row_index = torch.tensor(rows, device=self.device)  # [b]
        lengths = [self.lengths[r] for r in rows]
        self._write_pos = (torch.tensor(lengths, device=self.device)[:, None]
                           + torch.arange(num_new, device=self.device))  # [b, T]
        self._kv_len = max(lengths, default=0) + num_new  # from the list: no device sync on a GPU
        if self._kv_len > self.capacity:
            raise RuntimeError(f"KV cache too small: need {self._kv_len} positions, have {self.capacity}")

    def bound_rows(self) -> torch.Tensor:
        """[b] the cache row of each row the next forward feeds."""
        return self._row_index

    def bound_lengths(self) -> list[int]:
        return [self.lengths[r] for r in self._bound]

    def kv_length(self) -> int:
        """Keys each bound row attends over: the longest bound row's cached positions + the new tokens."""
        return self._kv_len

    def token_slots(self, flat: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> rows [M], positions [M]: where the bound forward's new tokens go (flat: which of its b x T tokens, in
        row-major order; None: all of them)."""
        rows = self._row_index[:, None].expand_as(self._write_pos).reshape(-1)  # [b x T]
        places = self._write_pos.reshape(-1)
        if flat is None:
            return rows, places
        flat = flat.to(self.device)
        return rows[flat], places[flat]

    def write_tokens(self, layer: int, rows: torch.Tensor, places: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor) -> None:
        """keys/values [M, kv_heads, head_dim] of M new tokens -> slot (rows[m], places[m]) of `layer`."""
        if len(self._bound) == 1 and rows.numel() == self._num_new:  # one row's whole block: a slice write
            start = self.lengths[self._bound[0]]
            self.keys[layer][self._bound[0], :, start:start + self._num_new] = keys.transpose(0, 1)
            self.values[layer][self._bound[0], :, start:start + self._num_new] = values.transpose(0, 1)
            return
        # Advanced indexing on dims 0 and 2 puts them first: the target is [M, kv_heads, head_dim].
        self.keys[layer][rows, :, places] = keys
        self.values[layer][rows, :, places] = values

    def bound_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound rows' keys and values [b, kv_heads, kv_len, head_dim]: a view when the rows are a contiguous
        range, else a gathered copy."""
        keys, values, kv_len = self.keys[layer], self.values[layer], self._kv_len
        if self._contiguous:
            first, last = self._bound[0], self._bound[-1] + 1
            return keys[first:last, :, :kv_len], values[first:last, :, :kv_len]
        return (keys.index_select(0, self._row_index)[:, :, :kv_len],
                values.index_select(0, self._row_index)[:, :, :kv_len])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """key_states/value_states: [b, kv_heads, T, head_dim]; returns this layer's [b, kv_heads, kv_len, head_dim]."""
        rows, places = self.token_slots()
        flat = (-1, self.kv_heads, self.head_dim)  # [b x T, kv_heads, head_dim]
        self.write_tokens(layer_idx, rows, places, key_states.transpose(1, 2).reshape(flat),
                          value_states.transpose(1, 2).reshape(flat))
        return self.bound_view(layer_idx)

    # ----------------------------------------------------------------------------------------------- HF Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Read by models only to build default positions/masks; the engine passes both explicitly.
        return self._kv_len - self._num_new

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv_length(), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        # Sliding-window layers keep every position here and get a windowed mask instead (model_runner builds it).
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        return len(self._bound)

    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        return f"SlotKVCache(rows={len(self.lengths)}, slots={self.slots}, capacity={self.capacity})"


def new_slot_cache(runner: ModelRunner) -> SlotKVCache:
    """An empty engine-owned cache for this model (rows are added by the batched loop)."""
    check_servable(runner.model.config)
    config = runner.model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return SlotKVCache(config.num_hidden_layers, kv_heads, head_dim, runner.dtype, runner.device)
