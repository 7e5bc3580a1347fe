"""What drafters may read of the target's own forwards: one layer's hidden states (PLD+ (h)) and the attention
weights of chosen heads (PLD+ (a)). The loop collects them during the forwards it runs anyway (prefill and verify),
only when a live row's drafter declares the need (HIDDEN_STATES, ATTENTION in `Drafter.reads`), and hands each such row
the part that belongs to the positions it just committed. Rows that do not ask cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..drafters.base import ATTENTION, HIDDEN_STATES, Drafter
from ..model.attention_probe import head_attention


@dataclass
class Signals:
    """What one forward should collect, and (after it) what it collected."""

    hidden: dict[int, torch.Tensor | None] = field(default_factory=dict)  # layer -> [b, T, hidden]
    heads: dict[int, list[int]] = field(default_factory=dict)  # layer -> head ids (union over the rows)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [b, len(heads[layer]), T, d]

    def forward_kwargs(self) -> dict:
        """StepBatch's recording fields: the forward fills `hidden`'s and `queries`' dicts in place."""
        return {"captured": self.hidden, "query_heads": self.heads, "queries": self.queries}


def wanted(drafters: list[Drafter]) -> Signals:
    signals = Signals()
    for drafter in drafters:
        if HIDDEN_STATES in drafter.reads:
            signals.hidden[drafter.hidden_layer] = None
        if ATTENTION in drafter.reads:
            for layer, heads in drafter.attention_heads.items():
                signals.heads[layer] = sorted(set(signals.heads.get(layer, [])) | set(heads))
    return signals


def hand_over(target, signals: Signals, drafter: Drafter, cache, cache_row: int, batch_row: int,
              nodes: list[int]) -> None:
    """Give `drafter` what it asked for about the step's input nodes that are now committed, in order: node t of
    batch row `batch_row`; the cache row (`cache_row`) holds them, its length already advanced past them."""
    if HIDDEN_STATES in drafter.reads:
        drafter.observe_hidden(signals.hidden[drafter.hidden_layer][batch_row, nodes])  # [len(nodes), hidden]
    if ATTENTION in drafter.reads:
        length = cache.lengths[cache_row]
        last = nodes[-1]  # the query of the newest committed token: it produced the pending token
        queries = {layer: signals.queries[layer][batch_row, [signals.heads[layer].index(h) for h in heads], last]
                   for layer, heads in drafter.attention_heads.items()}  # layer -> [n, d]
        keys = {layer: cache.keys[layer][cache_row] for layer in drafter.attention_heads}
        drafter.observe_attention(head_attention(target, keys, queries, drafter.attention_heads, length,
                                                 position=length - 1))  # [length]
