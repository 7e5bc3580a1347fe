"""Where a pass's time goes, method by method, in one process: prefill forwards, plain steps by row count, steps that
verified drafts by their real tokens, and the host work around them (the wall time less prefill and forwards).

  python benchmarks/step_log_bench.py --workload open_questions --requests 80 --batch-size 16 \
      --methods ar suffix auto --rounds 3

Whole-pass ratios on a 2-core machine move by ~5 % with nothing changed (docs/decisions.md); these parts move less,
and say whether a slow pass was the machine's (every step slower) or the budget's (more wide steps). A plain step's
median time at each row count gives what one more row costs; a wide step's excess over it, what one more verified
token costs at that row count.
Prints one block per pass; the machine and dtype in the header.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.batch_bench import WORKLOADS, hardware, run_ours, warm_up, workload_items  # noqa: E402
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402
from specdec_core.engine import Engine, EngineConfig  # noqa: E402
from specdec_core.loop.batch_decode import BatchDecoder  # noqa: E402
from specdec_core.model.model_runner import ModelRunner  # noqa: E402


class StepLog:
    """Every target forward of the passes it watches: (rows, width, real tokens, seconds), and prefill forwards."""

    def __init__(self):
        self.forwards: list[tuple[int, int, int, float]] = []  # decode steps only
        self.prefill_forwards = 0
        self.prefilling = False
        forward, prefill = ModelRunner.forward_slots, BatchDecoder._prefill_forward
        log = self

        def timed_forward(runner, cache, batch, *args, **kwargs):
            started = time.perf_counter()
            out = forward(runner, cache, batch, *args, **kwargs)
            if log.prefilling:
                return out
            real = int(batch.visible.diagonal(dim1=1, dim2=2).sum())  # the tokens that see themselves
            log.forwards.append((batch.input_ids.shape[0], batch.input_ids.shape[1], real,
                                 time.perf_counter() - started))
            return out

        def counted_prefill(decoder, *args, **kwargs):
            log.prefill_forwards += 1
            log.prefilling = True
            try:
                return prefill(decoder, *args, **kwargs)
            finally:
                log.prefilling = False

        ModelRunner.forward_slots = timed_forward
        BatchDecoder._prefill_forward = counted_prefill

    def clear(self) -> None:
        self.forwards.clear()
        self.prefill_forwards = 0


def summary(log: StepLog, result: dict, batch_size: int) -> str:
    """One pass's block: wall, prefill, forwards and host seconds; plain steps by rows; wide steps by real tokens."""
    steps = log.forwards
    step_s = sum(f[3] for f in steps)
    plain = defaultdict(list)
    wide = defaultdict(list)
    for rows, width, real, seconds in steps:
        if width == 1:
            plain[rows].append(seconds)
        elif rows == batch_size:
            wide[real // 8 * 8].append(seconds)
    host = result["wall_s"] - result["prefill_s"] - step_s
    lines = [f"{result['system']}: {result['new_tokens'] / result['wall_s']:.1f} tok/s, wall {result['wall_s']:.2f} s, "
             f"prefill {result['prefill_s']:.2f} s in {log.prefill_forwards} forwards, steps {step_s:.2f} s in "
             f"{len(steps)} ({sum(len(v) for v in wide.values())} wide at {batch_size} rows), host {host:.2f} s; "
             f"verified {result['verified']}, accepted {result['accepted']}",
             "  plain steps, rows: median ms (count): " + ", ".join(
                 f"{rows}: {statistics.median(v) * 1e3:.1f} ({len(v)})" for rows, v in sorted(plain.items())
                 if len(v) >= 3)]
    if wide:
        lines.append(f"  wide steps at {batch_size} rows, real tokens: median ms (count): " + ", ".join(
            f"{real}+: {statistics.median(v) * 1e3:.1f} ({len(v)})" for real, v in sorted(wide.items())))
    # a wide step's seconds over its row count's median plain step, per verified token: what the budget's s_token
    # prices (as a share of a plain step's seconds per row)
    extra = defaultdict(list)
    for rows, width, real, seconds in steps:
        if width > 1 and real > rows and len(plain.get(rows, ())) >= 3:
            extra[rows].append((seconds - statistics.median(plain[rows])) / (real - rows))
    if extra:
        lines.append("  one more verified token, by rows: median ms (steps): " + ", ".join(
            f"{rows}: {statistics.median(v) * 1e3:.2f} ({len(v)})" for rows, v in sorted(extra.items())))
    return "\n".join(lines)


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="open_questions", choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["ar", "suffix"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    if args.rounds < 1 or args.requests < 1 or args.batch_size < 1:
        parser.error("--rounds, --requests and --batch-size must be >= 1")
    torch.set_num_threads(os.cpu_count() or 1)
    log = StepLog()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    print(f"# {args.model}, dtype {engine.target.dtype_name}, {hardware(engine.target.device)}, {args.workload}: "
          f"{args.requests} requests, batch {args.batch_size}, {args.max_new_tokens} new tokens", flush=True)
    items = workload_items(engine, args.workload, args.requests, args.max_new_tokens, args.batch_size)
    warm_up(engine, items, args.methods, None, args.batch_size)
    for round_number in range(1, args.rounds + 1):
        print(f"## round {round_number}", flush=True)
        for method in args.methods:
            log.clear()
            result = run_ours(engine, items, method, args.batch_size, None)
            print(summary(log, result, args.batch_size), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
