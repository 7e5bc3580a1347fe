"""What recording a step's signals for PLD+ costs on a CPU: a batch of decode steps (one new token per row over
`--context` cached tokens) plain, recording PLD+ (h)'s layer output and recording PLD+ (a)'s induction heads'
queries, each with a step's layers in one compiled call each (kernels/decode_layer.py) and layer by layer.

Every mode runs once per round, in turn, in one process (this machine's speed drifts more than the differences);
prints the median milliseconds a step of each mode and each mode's ratio to the plain one-call step.

    .venv/bin/python benchmarks/recorded_step_bench.py --rows 16 --context 800
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec_core.drafters.induction_heads import load_or_discover, top_heads  # noqa: E402
from specdec_core.drafters.pld_plus import default_hidden_layer  # noqa: E402
from specdec_core.kernels import decode_layer  # noqa: E402
from specdec_core.kernels.linear_plan import cpu_description  # noqa: E402
from specdec_core.loop.kv_cache import new_slot_cache  # noqa: E402
from specdec_core.method_options import DEFAULTS  # noqa: E402
from specdec_core.model.model_runner import ModelRunner  # noqa: E402
from specdec_core.model.step_batch import StepBatch  # noqa: E402


def filled_cache(runner: ModelRunner, rows: int, context: int, generator: torch.Generator):
    """A cache of `rows` rows, each prefilled with `context` random tokens."""
    cache = new_slot_cache(runner)
    cache.fit(rows, context + 64)
    causal = torch.ones(context, context, dtype=torch.bool).tril()[None]
    for _ in range(rows):
        row = cache.add_row()
        ids = torch.randint(5, runner.model.config.vocab_size, (1, context), generator=generator)
        runner.forward_slots(cache, StepBatch(ids, torch.arange(context)[None], causal,
                                              torch.tensor([[0, context - 1]]), rows=[row], prefill=True))
        cache.set_length(row, context)
    return cache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=800, help="cached tokens a row")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if args.rounds <= 5 or args.rows < 1 or args.context < 1:
        parser.error("need --rounds > 5 (the first 5 warm up), --rows >= 1 and --context >= 1")

    runner = ModelRunner.load(args.model, dtype=args.dtype, device="cpu")
    if runner.fast is None or runner.fast.fused is None:
        print(f"{args.model} in {args.dtype} does not run its steps through decode_layer.py here: nothing to compare")
        return 1
    generator = torch.Generator().manual_seed(0)
    cache = filled_cache(runner, args.rows, args.context, generator)
    hidden = {default_hidden_layer(runner.num_layers): None}
    heads = top_heads(load_or_discover(runner), DEFAULTS.top_heads)
    index = torch.stack([torch.arange(args.rows), torch.zeros(args.rows, dtype=torch.long)], 1)  # [B, 2]

    def step(captured: dict, query_heads: dict) -> float:
        ids = torch.randint(5, runner.model.config.vocab_size, (args.rows, 1), generator=generator)
        positions = torch.tensor(cache.lengths)[:, None]  # [B, 1]: the rows' lengths are never advanced
        batch = StepBatch(ids, positions, torch.ones(args.rows, 1, 1, dtype=torch.bool), index,
                          captured=dict(captured), query_heads=dict(query_heads))
        started = time.perf_counter()
        runner.forward_slots(cache, batch)
        return time.perf_counter() - started

    usable = decode_layer.usable
    modes = {"plain": ({}, {}), "PLD+ (h) layer output": (hidden, {}), "PLD+ (a) queries": ({}, heads)}
    seconds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for path in ("one call a layer", "layer by layer"):
            decode_layer.usable = usable if path == "one call a layer" else (lambda *_: False)
            for name, (captured, query_heads) in modes.items():
                seconds.setdefault(f"{name}, {path}", []).append(step(captured, query_heads))
    decode_layer.usable = usable

    print(f"# {args.model} {args.dtype}, {cpu_description()}; {args.rows} rows x {args.context} cached tokens, "
          "one new token a row; "
          f"PLD+ (h) layer {next(iter(hidden))}, PLD+ (a) {sum(map(len, heads.values()))} heads in {len(heads)} "
          f"layers; median of {args.rounds - 5} rounds (the first 5 warm up)")
    medians = {name: statistics.median(times[5:]) for name, times in seconds.items()}
    base = medians["plain, one call a layer"]
    print("| step | ms | x plain one call a layer |")
    print("|---|---|---|")
    for name, median in medians.items():
        print(f"| {name} | {median * 1e3:.2f} | {median / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
