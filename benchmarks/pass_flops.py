"""How much of the machine a pass uses: the arithmetic of a workload's useful work (each prompt and output token
through the model once, as plain decoding computes it) against the machine's best measured matmul rate.

The work is the same for every engine and method of a side-by-side run (speculation's rejected tokens and padding
are not counted: they are the engine's overhead), so work / wall time is each system's achieved rate.
"""

from __future__ import annotations

from specdec_core.kernels import linear_plan


def token_flops(config) -> tuple[int, int, int]:
    """(linear FLOPs per token through the decoder layers, FLOPs per logits row of the LM head, attention FLOPs per
    token per key attended)."""
    shapes = linear_plan.model_shapes(config)
    layers = config.num_hidden_layers
    linears = 2 * layers * sum(out_features * in_features for out_features, in_features in shapes.values())
    head = 2 * config.vocab_size * config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 2 * 2 * layers * heads * head_dim  # q.k and p.v for each key, every layer
    return linears, head, attention


def work_flops(config, prompt_lengths: list[int], new_tokens: int) -> float:
    """FLOPs of the useful work: each prompt through prefill (one logits row), then new_tokens spread evenly over the
    requests, each through the layers and the head, attending every earlier position."""
    linears, head, attention = token_flops(config)
    each = new_tokens / len(prompt_lengths)
    total = 0.0
    for prompt in prompt_lengths:
        tokens = prompt + each
        total += linears * tokens + head * (1 + each) + attention * tokens * (tokens + 1) / 2
    return total


def best_matmul_rate(config, dtype, seconds_each: float = 0.1) -> tuple[float, str]:
    """The fastest GFLOP/s any linear candidate reached on the model's linear shapes at prefill sizes (1,024 and
    2,048 rows) on this machine, and which candidate and shape reached it."""
    timings = linear_plan.measure(linear_plan.model_shapes(config), [1024, 2048], dtype, seconds_each)
    top = max(timings, key=lambda t: t.gflops)
    return top.gflops, f"{top.candidate} on {top.shape} at {top.rows} rows"
