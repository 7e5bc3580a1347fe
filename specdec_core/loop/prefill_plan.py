"""Which admitted prompts share the next prefill forward, and how many of their tokens each feeds.

Prompts waiting for prefill are fed together, in admission order, as one padded [b, T] forward whose b x T stays
under a token budget; a prompt longer than the budget is cut into chunks of at most the budget, fed over several
forwards (its cache row grows chunk by chunk). Why a budget rather than one forward for everything: on a CPU a
prefill is compute-bound, so batching gains only where single prompts are too short to keep the matmuls busy, while
the padded mask and attention of a wide forward grow with b x T x keys (measurements: docs/decisions.md).
"""

from __future__ import annotations

# Padded tokens of one prefill forward: faster than one whole prompt per forward on every workload tried; smaller
# budgets gained less, larger ones lost on short prompts (decisions.md: specdec_core/loop/prefill_plan.py).
PREFILL_TOKENS = 1024
# A GPU's forward of 1,024 tokens is launch-bound: a batch's prompts go in a few wide forwards instead (64 prompts of
# 256 tokens in one; docs/decisions.md, session 5). The padded mask grows with b x T x keys.
GPU_PREFILL_TOKENS = 16384


def default_budget(device: str) -> int:
    """Padded prefill tokens per forward on `device`."""
    return PREFILL_TOKENS if str(device).startswith("cpu") else GPU_PREFILL_TOKENS


# A prompt that fills a forward of its own, fed from position 0, needs no mask: SDPA runs its causal kernel
# (model_runner._plain_prefill, 6-17 % faster). A prefix hit shifts its start and brings the mask back, so a small
# hit (a chat template before a long document) costs more than it saves.
MIN_HIT_SHARE = 1 / 8


def worth_reusing(hit: int, prompt: int, budget: int, masked: bool = True, rows_apart: bool = False) -> bool:
    """Whether a prefix hit of `hit` positions pays for a `prompt`-token prompt under a prefill budget of `budget`
    padded tokens: always where the prompt shares its forwards (they are masked anyway) or where no prefill is
    masked (`masked` False: bf16_attention.py attends any chain without one), else from MIN_HIT_SHARE. rows_apart:
    each row of a forward attends on its own (sdpa_chain_attention.py), so only a row with a hit is masked, as if
    it were fed alone."""
    alone = rows_apart or 2 * prompt > budget
    return hit > 0 and (not alone or not masked or hit >= MIN_HIT_SHARE * prompt)


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
