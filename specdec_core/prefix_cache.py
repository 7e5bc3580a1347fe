"""Keys and values of prompt prefixes, kept in blocks of BLOCK tokens and copied into later rows that share them.

A job's prompts share their first tokens: the chat template, the task's instruction, a shared context. A row whose
prompt starts with blocks computed before copies their keys and values into its cache row and prefills only the
rest. Blocks are chained as vLLM's prefix cache chains them: a block's key is its tokens and its parent block's
key, so a hit always covers a whole prefix, never a block that happens to repeat elsewhere.

Copy, not share: the engine's cache gives each row a contiguous slot (kv_cache.py), so a hit costs one copy of the
prefix (30 layers x 16 tokens of SmolLM2 in fp32: 0.7 MB a block), which is what makes the slot layout cheap here.
The store is bounded (least recently used blocks go first) and lives as long as its engine: a job's actor reuses
it over all its calls.

Numbers: a prefix's keys are the ones some earlier forward computed (alone, in a batch, or in chunks). In fp32 those
forwards agree to the last bits on the engine's CPUs (prefill_plan.py); the tests hold hit and miss to equal tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per block: fine enough to catch a chat template (~25 tokens) and cheap to copy
DEFAULT_BUDGET_BYTES = 256 << 20


@dataclass
class _Block:
    parent: int | None
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, kv_heads, BLOCK, head_dim]
    values: torch.Tensor


class PrefixCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, block: int = BLOCK):
        if budget_bytes < 0 or block < 1:
            raise ValueError("the prefix cache needs a budget >= 0 bytes and blocks of >= 1 token")
        self.budget_bytes = budget_bytes
        self.block = block
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def _chain(self, prompt: list[int], limit: int) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(key, parent key, tokens) of the prompt's whole blocks within its first `limit` tokens."""
        chain, parent = [], None
        for end in range(self.block, limit + 1, self.block):
            tokens = tuple(prompt[end - self.block: end])
            key = hash((parent, tokens))
            chain.append((key, parent, tokens))
            parent = key
        return chain

    def lookup(self, prompt: list[int]) -> list[_Block]:
        """The longest run of cached blocks the prompt starts with, leaving at least its last token to prefill
        (its logits give the first new token)."""
        found = []
        for key, parent, tokens in self._chain(prompt, len(prompt) - 1):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:
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
        """Write `blocks` at the start of cache row `row` and commit them; -> the positions now cached."""
        for index, block in enumerate(blocks):
            start = index * self.block
            for layer in range(cache.num_layers):
                cache.keys[layer][row, :, start: start + self.block] = block.keys[layer]
                cache.values[layer][row, :, start: start + self.block] = block.values[layer]
        length = len(blocks) * self.block
        cache.set_length(row, length)
        return length

    def store(self, cache, row: int, prompt: list[int]) -> None:
        """Keep the whole blocks of a prefilled row's prompt that the store does not hold yet."""
        if not self.budget_bytes:
            return
        chain = self._chain(prompt, min(len(prompt), cache.lengths[row]))
        for index, (key, parent, tokens) in enumerate(chain):
            if key in self._blocks:
                continue
            start = index * self.block
            keys = torch.stack([cache.keys[layer][row, :, start: start + self.block] for layer in range(cache.num_layers)])
            values = torch.stack([cache.values[layer][row, :, start: start + self.block]
                                  for layer in range(cache.num_layers)])
            self._blocks[key] = _Block(parent, tokens, keys, values)
            self.nbytes += 2 * keys.numel() * keys.element_size()
        self._touch([key for key, _, _ in chain])
        while self.nbytes > self.budget_bytes and self._blocks:
            _, old = self._blocks.popitem(last=False)
            self.nbytes -= 2 * old.keys.numel() * old.keys.element_size()

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0
