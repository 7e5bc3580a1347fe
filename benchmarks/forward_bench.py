"""One slot-cache forward of the real model four ways over the same cache: the fast forward (fast_forward.py) and
Hugging Face's modules, both on the panel kernel's fp32 linears (panel_linear.py); the fast forward on oneDNN's
reordered weights (packed_linear.py), as before the panel kernel; and the fast forward with --deterministic
(invariant_attention.py). Side by side in one process, alternating, median of the repeats.

  python benchmarks/forward_bench.py                          # SmolLM2, batch 16, contexts of ~170 and ~600 tokens
  python benchmarks/forward_bench.py --model qwen2.5-coder-0.5b --batch-size 8 --context 300

Cases: a plain decode step (T = 1), verify steps where every row feeds 3 or 5 tokens, a ragged verify step (a quarter
of the rows feed 5 tokens, the rest 1) and a shared prefill of 4 prompts x 256 tokens. Each prints ms per forward
for each, the ratios to the first, and the largest logit difference from it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.batch_bench import hardware  # noqa: E402
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402
from specdec_core.kernels import panel_linear  # noqa: E402
from specdec_core.loop.kv_cache import new_slot_cache
from specdec_core.model.model_runner import ModelRunner  # noqa: E402
from specdec_core.model.step_batch import StepBatch  # noqa: E402


def filled(runner: ModelRunner, rows: int, context: int):
    """A cache of `rows` rows holding `context` tokens each (random ids)."""
    cache = new_slot_cache(runner)
    cache.fit(rows, context + 64)
    generator = torch.Generator().manual_seed(0)
    for _ in range(rows):
        row = cache.add_row()
        ids = torch.randint(100, runner.vocab_size - 100, (1, context), generator=generator)
        runner.forward_slots(cache, StepBatch(ids, torch.arange(context)[None],
                             torch.ones(context, context, dtype=torch.bool).tril()[None],
                             torch.tensor([[0, context - 1]]), rows=[row]))
        cache.set_length(row, context)
    return cache


def step_inputs(cache, counts: list[int]):
    """A chain step: row r feeds counts[r] tokens after its cached ones."""
    width = max(counts)
    count = torch.tensor(counts)
    inside = torch.arange(width)[None] < count[:, None]  # [b, T]
    visible = torch.ones(width, width, dtype=torch.bool).tril()[None] & inside[:, :, None] & inside[:, None, :]
    positions = torch.tensor(cache.lengths)[:, None] + torch.arange(width)
    ids = torch.randint(100, 20000, (len(counts), width), generator=torch.Generator().manual_seed(1))
    return ids, positions, visible, inside.nonzero()


def prefill_inputs(runner, prompts: int, length: int):
    cache = new_slot_cache(runner)
    cache.fit(prompts, length + 64)
    rows = [cache.add_row() for _ in range(prompts)]
    ids = torch.randint(100, 20000, (prompts, length), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(length).repeat(prompts, 1)
    visible = torch.ones(length, length, dtype=torch.bool).tril()[None].repeat(prompts, 1, 1)
    return cache, (ids, positions, visible, torch.tensor([[r, length - 1] for r in rows]))


def timed(variant, cache, inputs, repeats: int) -> tuple[list[float], torch.Tensor]:
    runner, fast, deterministic = variant
    runner.fast = fast
    runner.deterministic = deterministic
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        logits = runner.forward_slots(cache, StepBatch(*inputs))
        times.append(time.perf_counter() - started)
    return times, logits


def compare(variants: dict, name: str, cache, inputs, repeats: int, rounds: int) -> None:
    """Alternate the variants `rounds` times, `repeats` forwards each (the lengths are not advanced: every forward
    writes the same positions)."""
    times = {label: [] for label in variants}
    logits = {}
    for _ in range(rounds):
        for label, variant in variants.items():
            spent, logits[label] = timed(variant, cache, inputs, repeats)
            times[label] += spent
    for runner, fast, _ in variants.values():
        runner.fast, runner.deterministic = fast if fast is not None else runner.fast, False
    first = next(iter(variants))
    ms = {label: statistics.median(spent) * 1e3 for label, spent in times.items()}
    cells = "   ".join(f"{label} {ms[label]:8.2f} ms ({ms[label] / ms[first]:4.2f})" for label in variants)
    diff = max(float((logits[label] - logits[first]).abs().max()) for label in variants)
    print(f"{name:<30} {cells}   max |logit diff| {diff:.1e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, action="append", help="cached tokens per row (repeatable)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    runner = ModelRunner.load(args.model, dtype=args.dtype, device="cpu")
    before = os.environ.get(panel_linear.DISABLE_ENV)
    os.environ[panel_linear.DISABLE_ENV] = "0"  # for this load only: --deterministic reads it too
    try:
        onednn = ModelRunner.load(args.model, dtype=args.dtype, device="cpu")
    finally:
        if before is None:
            del os.environ[panel_linear.DISABLE_ENV]
        else:
            os.environ[panel_linear.DISABLE_ENV] = before
    if runner.fast is None or onednn.fast is None:
        print(f"{args.model}: the fast forward does not cover this model")
        return 1
    variants = {"fast": (runner, runner.fast, False), "HF": (runner, None, False),
                "fast+oneDNN": (onednn, onednn.fast, False), "deterministic": (runner, runner.fast, True)}
    print(f"{hardware('cpu')}, dtype {runner.dtype_name}, {args.model}, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads; ms per forward (time / the first's)")
    b = args.batch_size
    for context in args.context or [170, 600]:
        cache = filled(runner, b, context)
        quarter = [5 if r % 4 == 0 else 1 for r in range(b)]
        for name, counts in (("decode T=1", [1] * b), ("verify T=3, all rows", [3] * b),
                             ("verify T=5, all rows", [5] * b),
                             ("verify, 1/4 of rows T=5", quarter)):
            compare(variants, f"ctx {context}, {name}", cache, step_inputs(cache, counts), args.repeats, args.rounds)
    cache, inputs = prefill_inputs(runner, 4, 256)
    compare(variants, "prefill 4 x 256", cache, inputs, 1, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
