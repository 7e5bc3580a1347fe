"""Which admitted prompts share the next prefill forward, and how many of their tokens each feeds.

Prompts waiting for prefill are fed together, in admission order, as one padded [b, T] forward whose b x T stays
under a token budget; a prompt longer than the budget is cut into chunks of at most the budget, fed over several
forwards (its cache row grows chunk by chunk). Why a budget rather than one forward for everything: on a CPU a
prefill is compute-bound, so batching gains only where single prompts are too short to keep the matmuls busy, while
the padded mask and attention of a wide forward grow with b x T x keys (measurements: docs/decisions.md).
"""

from __future__ import annotations

# Padded tokens of one prefill forward. Measured on a 2-core AVX2 CPU (SmolLM2, fp32): 16 short questions (52-138
# tokens) prefilled at 247 tok/s one by one, 392 tok/s at 512, 274 at 2048; a 1,255-token prompt at 318 tok/s whole
# and 346 tok/s in chunks of 512 (bit-identical logits).
PREFILL_TOKENS = 512


def next_forward(remaining: list[int], done: list[int], capacity: int, budget: int = PREFILL_TOKENS) -> list[int]:
    """remaining[i] / done[i]: prompt tokens still to feed / already cached of the i-th pending row, in order.
    -> the chunk lengths of the first k >= 1 rows that the next forward feeds: their padded width times k stays
    within `budget`, and no row's padding runs past the cache's `capacity` positions."""
    if budget < 1:
        raise ValueError(f"the prefill token budget must be >= 1, got {budget}")
    chunks: list[int] = []
    width = deepest = 0
    for left, cached in zip(remaining, done):
        chunk = min(left, budget)
        wider, deeper = max(width, chunk), max(deepest, cached)
        if chunks and ((len(chunks) + 1) * wider > budget or deeper + wider > capacity):
            break
        chunks.append(chunk)
        width, deepest = wider, deeper
    return chunks
