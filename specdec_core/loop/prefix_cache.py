"""Keys and values of prompt prefixes, kept in blocks of BLOCK tokens and copied into later rows that share them.

A job's prompts share their first tokens: the chat template, the task's instruction, a shared context. A row whose
prompt starts with blocks computed before copies their keys and values into its cache row and prefills only the
rest. Blocks are chained as vLLM's prefix cache chains them: a block's key is its tokens and its parent block's
key, so a hit always covers a whole prefix, never a block that happens to repeat elsewhere.

Copy, not share: the engine's cache gives each row a contiguous slot (kv_cache.py), so a hit costs one copy of the
prefix (a block's keys and values in every layer), which is what makes the slot layout cheap here.
The store is bounded (least recently used blocks go first) and lives as long as its engine: a job's actor reuses
it over all its calls.

Numbers: a prefix's keys are the ones some earlier forward computed (alone, in a batch, or in chunks). In fp32 those
forwards agree to the last bits on the engine's CPUs (prefill_plan.py); the tests hold hit and miss to equal tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per block: fine enough to catch a chat template (~25 tokens) and cheap to copy
DEFAULT_BUDGET_BYTES = 256 << 20


@dataclass(eq=False)  # identity: a span and its blocks hold tensors
class _Span:
    """One allocation holding the blocks a row stored together, filled with one copy per layer (a kernel launch
    each on a GPU). Its bytes count until its last block goes; when evictions leave it half empty, its live blocks
    move to a smaller span, so a hot block (a chat template) never pins a whole prompt's worth. The cost: live
    blocks may fill only half the budget, and an eviction may take up to half a span more than it needed."""

    keys: torch.Tensor  # [blocks, layers, kv_heads, BLOCK, head_dim]
    values: torch.Tensor
    blocks: list["_Block"] = field(default_factory=list)  # its blocks still in the store

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


@dataclass(eq=False)
class _Block:
    parent: object  # the parent block's key, or the chain's scope
    tokens: tuple[int, ...]
    span: _Span
    index: int  # in span
    # layer -> [BLOCK, hidden] the target's states there (store_hidden): what a row whose drafter reads them
    # (PLD+ (h)) needs besides the keys and values to take the block from the store
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def hidden_bytes(self) -> int:
        return sum(states.numel() * states.element_size() for states in self.hidden.values())

    @property
    def keys(self) -> torch.Tensor:  # [layers, kv_heads, BLOCK, head_dim]
        return self.span.keys[self.index]

    @property
    def values(self) -> torch.Tensor:
        return self.span.values[self.index]


class PrefixCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, block: int = BLOCK):
        if budget_bytes < 0 or block < 1:
            raise ValueError("the prefix cache needs a budget >= 0 bytes and blocks of >= 1 token")
        self.budget_bytes = budget_bytes
        self.block = block
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def scope(self, name: object) -> "ScopedPrefixCache":
        """This store as one reader sees it: only the blocks stored under the same `name` match (a job's methods
        each prefill their own prompts, so a method's figures never include another's prefill); one byte budget."""
        return ScopedPrefixCache(self, name)

    def _chain(self, prompt: list[int], limit: int, scope: object = None
               ) -> list[tuple[int, object, tuple[int, ...]]]:
        """(key, parent key, tokens) of the prompt's whole blocks within its first `limit` tokens; a chain's first
        parent is its scope."""
        chain, parent = [], scope
        for end in range(self.block, limit + 1, self.block):
            tokens = tuple(prompt[end - self.block: end])
            key = hash((parent, tokens))
            chain.append((key, parent, tokens))
            parent = key
        return chain

    def lookup(self, prompt: list[int], scope: object = None, hidden_layer: int | None = None) -> list[_Block]:
        """The longest run of cached blocks the prompt starts with, leaving at least its last token to prefill
        (its logits give the first new token); with `hidden_layer`, of blocks that hold that layer's states too."""
        found = []
        for key, parent, tokens in self._chain(prompt, len(prompt) - 1, scope):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:
                break
            if hidden_layer is not None and hidden_layer not in block.hidden:
                break
            found.append((key, block))
        self._touch([key for key, _ in found])
        return [block for _, block in found]

    def _touch(self, keys: list[int]) -> None:
        """Mark a chain used, its first block last: eviction then takes a chain's tail before its head, never
        leaving blocks whose parent is gone."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def copy_into(self, cache, row: int, blocks: list[_Block]) -> int:
        """Write `blocks` at the start of cache row `row` and commit them; -> the positions now cached. A run of
        blocks stored together is written with one copy per layer."""
        start = 0
        for span, first, count in _runs(blocks):
            end = start + count * self.block
            for layer in range(cache.num_layers):
                for buffers, stored in ((cache.keys, span.keys), (cache.values, span.values)):
                    target = buffers[layer][row, :, start:end]  # [kv_heads, count x BLOCK, head_dim]
                    target.unflatten(1, (count, self.block)).copy_(stored[first:first + count, layer].transpose(0, 1))
            start = end
        cache.set_length(row, start)
        return start

    def store(self, cache, row: int, prompt: list[int], scope: object = None) -> None:
        """Keep the whole blocks of a prefilled row's prompt that the store does not hold yet, in one span: one
        copy per layer, not one per block and layer (each a kernel launch on a GPU)."""
        if not self.budget_bytes:
            return
        chain = self._chain(prompt, min(len(prompt), cache.lengths[row]), scope)
        new = [index for index, (key, _, _) in enumerate(chain) if key not in self._blocks]
        if new:
            count, first = len(new), new[0] * self.block
            contiguous = new[-1] - new[0] + 1 == count  # the usual case: after the hits, every block is new
            where = None if contiguous else torch.cat(
                [torch.arange(i * self.block, (i + 1) * self.block) for i in new]).to(cache.device)
            shape = (count, cache.num_layers, cache.kv_heads, self.block, cache.head_dim)
            span = _Span(torch.empty(shape, dtype=cache.dtype, device=cache.device),
                         torch.empty(shape, dtype=cache.dtype, device=cache.device))
            for layer in range(cache.num_layers):
                for buffers, stored in ((cache.keys, span.keys), (cache.values, span.values)):
                    held = buffers[layer][row]  # [kv_heads, capacity, head_dim]
                    held = held[:, first:first + count * self.block] if contiguous else held.index_select(1, where)
                    stored[:, layer].copy_(held.unflatten(1, (count, self.block)).transpose(0, 1))
            for place, index in enumerate(new):
                key, parent, tokens = chain[index]
                self._blocks[key] = _Block(parent, tokens, span, place)
                span.blocks.append(self._blocks[key])
            self.nbytes += span.nbytes
        self._touch([key for key, _, _ in chain])
        self._evict()

    def store_hidden(self, prompt: list[int], layer: int, states: torch.Tensor, scope: object = None) -> None:
        """Keep `layer`'s states ([>= len(prompt), hidden], a prefilled row's, position by position) with the
        prompt's blocks that the store holds without them."""
        if not self.budget_bytes:
            return
        for number, (key, parent, tokens) in enumerate(self._chain(prompt, min(len(prompt), len(states)), scope)):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:
                break
            if layer not in block.hidden:
                block.hidden[layer] = states[number * self.block: (number + 1) * self.block].clone()
                self.nbytes += block.hidden[layer].numel() * block.hidden[layer].element_size()
        self._evict()

    def _evict(self) -> None:
        """Least recently used blocks go until the store is within its budget."""
        while self.nbytes > self.budget_bytes and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self.nbytes -= old.hidden_bytes
            span = old.span
            span.blocks.remove(old)
            if 2 * len(span.blocks) <= len(span.keys):
                self.nbytes -= span.nbytes
                if span.blocks:
                    self.nbytes += self._repack(span).nbytes

    @staticmethod
    def _repack(span: _Span) -> _Span:
        """Move a span's live blocks into a span of their own size (a copy); -> the new span."""
        where = torch.tensor([block.index for block in span.blocks], device=span.keys.device)
        packed = _Span(span.keys.index_select(0, where), span.values.index_select(0, where), span.blocks)
        for place, block in enumerate(packed.blocks):
            block.span, block.index = packed, place
        return packed

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0


class ScopedPrefixCache:
    """A PrefixCache's blocks of one scope (PrefixCache.scope): what a decoder reads and writes."""

    def __init__(self, shared: PrefixCache, name: object):
        self.shared, self.name = shared, name
        self.block = shared.block

    def lookup(self, prompt: list[int], hidden_layer: int | None = None) -> list[_Block]:
        return self.shared.lookup(prompt, self.name, hidden_layer)

    def copy_into(self, cache, row: int, blocks: list[_Block]) -> int:
        return self.shared.copy_into(cache, row, blocks)

    def store(self, cache, row: int, prompt: list[int]) -> None:
        self.shared.store(cache, row, prompt, self.name)

    def store_hidden(self, prompt: list[int], layer: int, states: torch.Tensor) -> None:
        self.shared.store_hidden(prompt, layer, states, self.name)


def _runs(blocks: list[_Block]) -> list[tuple[_Span, int, int]]:
    """(span, first index, count) of each run of consecutive blocks that one span holds, in order."""
    runs: list[list] = []
    for block in blocks:
        if runs and runs[-1][0] is block.span and runs[-1][1] + runs[-1][2] == block.index:
            runs[-1][2] += 1
        else:
            runs.append([block.span, block.index, 1])
    return [tuple(run) for run in runs]
