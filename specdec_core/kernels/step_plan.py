"""Which kernel attends a bf16 decode or verify step on this machine: bf16_step_attention.py (the dot-product
instruction) or amx_step_attention.py (the AMX tiles), timed on the model's heads at its first load on the machine
as chain_plan.py times the prompt attention, and kept in its plan.

Why: where a CPU has AMX, its tiles made a verify step's attention cost about a decode step's, where the
dot-product kernel's grew with the width (measurements: docs/decisions.md, "AMX tiles of our own"); on a CPU without
AMX only the dot-product kernel runs.
"""

from __future__ import annotations

import time

import torch

from . import amx_step_attention, bf16_step_attention

CANDIDATES = {"bf16_dot": bf16_step_attention, "amx": amx_step_attention}
DEFAULT = "bf16_dot"
ROUNDS = 4
# A batch's rows of cached keys, in distinct buffers per layer (~100 MB in all), so that they are read from memory as
# a step's are (a few buffers stayed in the last-level cache, and favoured the kernel with less arithmetic to hide).
ROWS, KEYS, LAYERS = 16, 512, 16
WIDTHS = (1, 4)  # a decode step and a verify step of 4 tokens a row


def measure(heads: int, kv_heads: int, head_dim: int) -> dict[str, list[float]]:
    """{candidate: [ms of one layer's attention at each of WIDTHS]}, the best of ROUNDS rounds that call every
    candidate in turn, for the candidates that run here (none where neither does)."""
    names = [name for name, module in CANDIDATES.items() if module.usable(head_dim)]
    if not names:
        return {}
    generator = torch.Generator().manual_seed(0)
    shape = (ROWS, kv_heads, KEYS + max(WIDTHS), head_dim)
    keys, values = (torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(2))
    keys, values = [keys.clone() for _ in range(LAYERS)], [values.clone() for _ in range(LAYERS)]
    lengths, slots = torch.full((ROWS,), KEYS), torch.arange(ROWS)
    best = {name: [float("inf")] * len(WIDTHS) for name in names}
    with torch.inference_mode():
        for w, width in enumerate(WIDTHS):
            visible = torch.ones(ROWS, width, width, dtype=torch.bool).tril()
            query = torch.randn(ROWS, heads, width, head_dim, generator=generator).to(torch.bfloat16)
            steps = {name: CANDIDATES[name].Step(visible, lengths, slots) for name in names}
            for turn in range(ROUNDS + 1):
                for name in names[turn % len(names):] + names[:turn % len(names)]:
                    started = time.perf_counter()
                    for layer in range(LAYERS):
                        steps[name].attend(query, keys[layer], values[layer], head_dim ** -0.5)
                    took = (time.perf_counter() - started) * 1e3 / LAYERS
                    if turn:  # the first round compiles and warms up
                        best[name][w] = min(best[name][w], took)
    return best


def choose(timings: dict[str, list[float]]) -> str:
    """The candidate whose decode and verify steps took least together (DEFAULT when none was timed)."""
    return min(timings, key=lambda name: sum(timings[name])) if timings else DEFAULT


def kernel(name: str):
    """The module whose `Step` a plan's choice names."""
    return CANDIDATES.get(name, CANDIDATES[DEFAULT])
