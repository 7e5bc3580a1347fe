"""What drafters may read of the target's own forwards: one layer's hidden states (PLD+ (h)) and the attention
weights of chosen heads (PLD+ (a)). The loop collects them during the forwards it runs anyway (prefill and verify),
only when a live row's drafter declares the need (HIDDEN_STATES, ATTENTION in `Drafter.reads`), and hands each such row
the part that belongs to the positions it just committed. Rows that do not ask cost nothing. Attention weights are
computed only when a row proposes and its drafter will read them (`Drafter.wants_attention`), for all such rows at
once: while drafting rests, or where the pending token has one earlier occurrence to copy after, they cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..drafters.base import ATTENTION, HIDDEN_STATES, Drafter
from ..model.attention_probe import rows_attention


@dataclass
class Signals:
    """What one forward should collect, and (after it) what it collected."""

    hidden: dict[int, torch.Tensor | None] = field(default_factory=dict)  # layer -> [b, T, hidden]
    heads: dict[int, list[int]] = field(default_factory=dict)  # layer -> head ids (union over the rows)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [b, len(heads[layer]), T, d]
    _positions: dict = field(default_factory=dict)  # positions()'s answers

    def forward_kwargs(self) -> dict:
        """StepBatch's recording fields: the forward fills `hidden`'s and `queries`' dicts in place."""
        return {"captured": self.hidden, "query_heads": self.heads, "queries": self.queries}

    def positions(self, layer: int, heads: list[int]) -> list[int]:
        """Where `heads` (a drafter's, in its order) sit among the layer's recorded heads."""
        key = (layer, tuple(heads))
        if key not in self._positions:
            self._positions[key] = [self.heads[layer].index(h) for h in heads]
        return self._positions[key]


def wanted(drafters: list[Drafter]) -> Signals:
    signals = Signals()
    for drafter in drafters:
        if HIDDEN_STATES in drafter.reads:
            signals.hidden[drafter.hidden_layer] = None
        if ATTENTION in drafter.reads:
            for layer, heads in drafter.attention_heads.items():
                signals.heads[layer] = sorted(set(signals.heads.get(layer, [])) | set(heads))
    return signals


@dataclass
class PendingAttention:
    """The attention weights a row's drafter asked for at a commit, computed only if the row proposes
    (deliver_attention): the forward's recorded queries, the row's batch row and newest committed node in it."""

    signals: Signals
    batch_row: int
    node: int
    length: int  # the row's keys: 0..length-1


def hand_over(signals: Signals, drafter: Drafter, cache, cache_row: int, batch_row: int,
              nodes: list[int]) -> PendingAttention | None:
    """Give `drafter` what it asked for about the step's input nodes that are now committed, in order: node t of
    batch row `batch_row`; the cache row (`cache_row`) holds them, its length already advanced past them. -> the
    attention weights it asks for (ATTENTION readers), to compute only if the row proposes (deliver_attention)."""
    if HIDDEN_STATES in drafter.reads:
        drafter.observe_hidden(signals.hidden[drafter.hidden_layer][batch_row, nodes])  # [len(nodes), hidden]
    if ATTENTION not in drafter.reads:
        return None
    # the query of the newest committed token: it produced the pending token
    return PendingAttention(signals, batch_row, nodes[-1], cache.lengths[cache_row])


def deliver_attention(target, cache, pending: list[tuple[Drafter, PendingAttention, int]]) -> None:
    """The weights of every (drafter, what it asked, its row's cache row now), each to its drafter, in one pass over
    the rows' keys per forward and head set (a step's rows share both); drafters whose next proposal will not read
    them (Drafter.wants_attention) are left out by the caller."""
    groups: dict[tuple, list] = {}
    for entry in pending:
        drafter, asked, _ = entry
        key = (id(asked.signals), tuple((layer, tuple(h)) for layer, h in sorted(drafter.attention_heads.items())))
        groups.setdefault(key, []).append(entry)
    for group in groups.values():
        signals, heads = group[0][1].signals, group[0][0].attention_heads
        batch_rows = torch.tensor([asked.batch_row for _, asked, _ in group])  # [R]
        nodes = torch.tensor([asked.node for _, asked, _ in group])  # [R]
        queries = {layer: signals.queries[layer][batch_rows, :, nodes][:, signals.positions(layer, layer_heads)]
                   for layer, layer_heads in heads.items()}  # layer -> [R, n, d]
        lengths = [asked.length for _, asked, _ in group]
        weights = rows_attention(target, cache.keys, [row for _, _, row in group], lengths, heads, queries)
        for r, (drafter, _, _) in enumerate(group):
            drafter.observe_attention(weights[r, : lengths[r]])  # [length]
