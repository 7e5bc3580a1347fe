"""Replay a token-only drafter against a known greedy output: the decoder's exact accepted lengths, no target.

Greedy decoding with a lossless drafter emits `ar`'s very tokens (test_lossless), so along any draft the target's
argmax is known in advance: node d of the path that matches the output is followed by output[t + d]. A drafter that
reads nothing from the target but the token sequence (no hidden states, attention, draft logits or draft-model pool)
therefore proposes here exactly what it proposes in the batched decoder with every draft verified (budget=off), and
the walk below reproduces the decoder's steps: the same drafts, accepted lengths and target forwards (prefill + one
per step), at the cost of the drafter alone. That makes accepted-length ablations over hundreds of requests cheap
(benchmarks/retrieval_ablation.py); a wall-clock speed still needs the decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from specdec_core.drafters.base import Drafter, RequestContext
from specdec_core.loop.verification import greedy_accepted


@dataclass
class ReplayResult:
    new_tokens: int = 0
    target_forwards: int = 0  # prefill + one per step, as DecodeMetrics counts them
    drafted: int = 0  # draft tokens proposed (= verified: every draft is verified)
    accepted: int = 0
    steps_with_draft: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def add(self, other: "ReplayResult") -> None:
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def check_replayable(drafter: Drafter) -> None:
    """A drafter that reads the target (or a draft model) cannot be replayed from tokens alone."""
    reads = sorted(drafter.reads) + (["a draft-model pool"] if drafter.pool is not None else [])
    if reads:
        raise ValueError(f"{type(drafter).__name__} reads {', '.join(reads)}: only token-only drafters replay")


def replay_greedy(drafter: Drafter, prompt_ids: Sequence[int], output_ids: Sequence[int], max_new_tokens: int,
                  context_ids: list[int] | None = None, max_draft: int = 64) -> ReplayResult:
    """Walk `output_ids` (a greedy output of `prompt_ids`, at most max_new_tokens long) step by step as the decoder
    would with `drafter` and every draft verified. `max_draft` is the decoder's cap (BatchDecoder.max_draft)."""
    check_replayable(drafter)
    result = ReplayResult(new_tokens=len(output_ids))
    if not output_ids:
        return result
    output = list(output_ids)
    tokens = list(prompt_ids) + output[:1]  # prefill produced the first token; the drafter's view is append-only
    result.target_forwards = 1
    drafter.start(tokens, RequestContext(prompt_len=len(prompt_ids), context_ids=context_ids))
    try:
        done = 1  # output tokens emitted so far
        while done < len(output):
            # draft_budget(): no draft may pass max_new_tokens (the step's own token included)
            limit = max(0, min(max_draft, max_new_tokens - done - 1))
            draft = drafter.propose(tokens, limit).truncated(limit)
            accepted = greedy_accepted(draft, output[done: done + len(draft) + 1])  # the output's end stops it
            if len(draft):
                result.drafted += len(draft)
                result.steps_with_draft += 1
            step = min(accepted + 1, len(output) - done)  # an EOS inside the accepted path ends the output
            result.accepted += step - 1
            tokens.extend(output[done: done + step])
            done += step
            result.target_forwards += 1
            drafter.observe(tokens, draft, accepted)
    finally:
        drafter.finish()
    return result
