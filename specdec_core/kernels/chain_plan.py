"""Which kernel attends a bf16 prompt chain on this machine: bf16_attention.py (the dot-product instruction) or
sdpa_chain_attention.py (PyTorch's flash kernel, row by row), timed on the model's heads as kernel_plan.py times
the linears, at the model's first load on the machine, and kept in its plan.

Why: the faster one depends on the CPU class, not on its flags: on an AMX CPU SDPA ran a prompt's attention
faster than ours; on an avx512_bf16 CPU without AMX ours was the faster (measurements: docs/decisions.md, "AMX").
"""

from __future__ import annotations

import time

import torch

from . import bf16_attention, sdpa_chain_attention

CANDIDATES = {"bf16_attention": bf16_attention, "sdpa": sdpa_chain_attention}
DEFAULT = "bf16_attention"
ROUNDS = 5
# One prefill forward's rows, as the admission packs them: prompts from position 0 and later chunks over cached keys.
STARTS, NEW = (0, 0, 256, 256), 256


def measure(heads: int, kv_heads: int, head_dim: int) -> dict[str, float]:
    """{candidate: ms of one layer's attention over STARTS x NEW tokens, the best of ROUNDS rounds that call every
    candidate in turn}, for the candidates that run here."""
    names = [name for name in CANDIDATES if name != "bf16_attention" or bf16_attention.usable(head_dim)]
    generator = torch.Generator().manual_seed(0)
    rows = len(STARTS)
    capacity = max(STARTS) + NEW
    keys = torch.randn(rows, kv_heads, capacity, head_dim, generator=generator).to(torch.bfloat16)
    values = torch.randn(rows, kv_heads, capacity, head_dim, generator=generator).to(torch.bfloat16)
    query = torch.randn(rows, heads, NEW, head_dim, generator=generator).to(torch.bfloat16)
    slots, lengths, news = torch.arange(rows), torch.tensor(STARTS), torch.full((rows,), NEW)
    best = {}
    with torch.inference_mode():
        for turn in range(ROUNDS + 1):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                started = time.perf_counter()
                CANDIDATES[name].attend(query, keys, values, slots, lengths, news, head_dim ** -0.5)
                took = (time.perf_counter() - started) * 1e3
                if turn:  # the first round compiles and warms up
                    best[name] = min(best.get(name, took), took)
    return best


def choose(timings: dict[str, float]) -> str:
    """The fastest candidate timed (DEFAULT when none was)."""
    return min(timings, key=timings.get) if timings else DEFAULT


def kernel(name: str):
    """The module whose `attend` a plan's choice names."""
    return CANDIDATES.get(name, CANDIDATES[DEFAULT])
