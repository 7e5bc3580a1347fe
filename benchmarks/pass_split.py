"""Where a pass's time goes: its prefill forwards, its decode forwards (one token a row), its verify forwards (by
width) and everything else (the loop's host work, drafting, sampling), for our engine on one workload. Forwards
are timed by wrapping the fast forward's `run` (model/fast_forward.py); the rest is the pass's wall time minus them.

Use it with peer_bench.py's `--max-new-tokens 1` (the peers' prefill alone) to tell a gap in prefill from one in
decoding.

  python benchmarks/pass_split.py                                   # 16 code edits, batch 16, ar and suffix
  python benchmarks/pass_split.py --workload summarization --requests 48 --methods ar pld

Each method runs one untimed pass (compiles, first allocations), then --rounds timed ones, the methods in turn
within each round. After the table, each timed pass's steps in detail: plain steps' median by row count, steps that
verified drafts at the full batch by their real tokens, and one more verified token's cost by row count (a wide
step's seconds over its row count's median plain step; the fast forward's run, so without the LM head, which is in
"other"): whether a slow pass was the machine's (every step slower) or the budget's (more wide steps).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.batch_bench import WORKLOADS, hardware, workload_items  # noqa: E402
from specdec_core import Engine, EngineConfig  # noqa: E402
from specdec_core.loop.batch_decode import BatchDecoder  # noqa: E402
from specdec_core.model import fast_forward  # noqa: E402


class ForwardTimer:
    """Seconds and calls of the fast forward's runs, by kind: "prefill" (inside the decoder's prefill forwards), or
    "T=<tokens a row>"; and every step's (rows, width, real tokens, seconds)."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.steps: list[tuple[int, int, int, float]] = []
        self._run, self._prefill = fast_forward.FastForward.run, BatchDecoder._prefill_forward
        self._prefilling = False

    def __enter__(self) -> "ForwardTimer":
        timer, run, prefill = self, self._run, self._prefill

        def timed(forward, cache, batch, attention, real):
            started = time.perf_counter()
            try:
                return run(forward, cache, batch, attention, real)
            finally:
                seconds, (rows, width) = time.perf_counter() - started, batch.input_ids.shape
                kind = "prefill" if timer._prefilling else f"T={width}"
                timer.seconds[kind] += seconds
                timer.calls[kind] += 1
                if not timer._prefilling:  # real: the tokens that see themselves (a row's pending token and drafts)
                    timer.steps.append((rows, width, int(batch.visible.diagonal(dim1=1, dim2=2).sum()), seconds))

        def prefilling(decoder, *args, **kwargs):
            timer._prefilling = True
            try:
                return prefill(decoder, *args, **kwargs)
            finally:
                timer._prefilling = False

        fast_forward.FastForward.run = timed
        BatchDecoder._prefill_forward = prefilling
        return self

    def __exit__(self, *exc) -> None:
        fast_forward.FastForward.run, BatchDecoder._prefill_forward = self._run, self._prefill

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.steps.clear()


def split_line(method: str, wall: float, tokens: int, timer: ForwardTimer) -> str:
    forwards = sum(timer.seconds.values())
    steps = {k: v for k, v in timer.seconds.items() if k != "prefill"}
    decode = timer.seconds.get("T=1", 0.0)
    verify = sum(steps.values()) - decode
    prefill = timer.seconds.get("prefill", 0.0)
    widths = ", ".join(f"{k} {timer.calls[k]} x {1e3 * timer.seconds[k] / timer.calls[k]:.1f} ms"
                       for k in sorted(steps, key=lambda k: int(k[2:])))
    return (f"| {method} | {tokens / wall:.1f} | {wall:.2f} | {prefill:.2f} ({prefill / wall:.0%}) | "
            f"{decode:.2f} | {verify:.2f} | {wall - forwards:.2f} ({(wall - forwards) / wall:.0%}) | "
            f"{timer.calls['prefill']} | {widths} |")


def step_details(method: str, steps: list[tuple[int, int, int, float]], batch_size: int) -> str:
    """Plain steps' median ms by row count; wide steps' at `batch_size` rows by real tokens (in eights); one more
    verified token's ms by row count."""
    plain, wide, extra = (collections.defaultdict(list) for _ in range(3))
    for rows, width, real, seconds in steps:
        if width == 1:
            plain[rows].append(seconds)
        elif rows == batch_size:
            wide[real // 8 * 8].append(seconds)
    plain_median = {rows: statistics.median(v) for rows, v in plain.items() if len(v) >= 3}
    for rows, width, real, seconds in steps:
        if width > 1 and real > rows and rows in plain_median:
            extra[rows].append((seconds - plain_median[rows]) / (real - rows))

    def medians(groups, suffix="", digits=1, least=1):
        return ", ".join(f"{key}{suffix}: {statistics.median(v) * 1e3:.{digits}f} ({len(v)})"
                         for key, v in sorted(groups.items()) if len(v) >= least)

    lines = [f"- {method}: plain steps by rows, median ms (count): {medians(plain, least=3)}"]
    if wide:
        lines.append(f"  steps that verified drafts at {batch_size} rows, by real tokens: {medians(wide, '+')}")
    if extra:
        lines.append(f"  one more verified token by rows, ms: {medians(extra, digits=2)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="code_edit", choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["ar", "suffix"])
    parser.add_argument("--rounds", type=int, default=1, help="timed passes of each method (default 1)")
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig())
    if engine.target.fast is None:
        print("this model runs Hugging Face's forward, which this split does not time", file=sys.stderr)
        return 2
    print(f"# {engine.target.name}, {engine.target.dtype}, {hardware('cpu')}; {args.workload}: {args.requests} "
          f"requests, {args.max_new_tokens} new tokens, batch {args.batch_size}")
    print("| method | tok/s | wall s | prefill s | decode s (T=1) | verify s | other s | prefill forwards | "
          "steps by width |")
    print("|---|---|---|---|---|---|---|---|---|")
    items = workload_items(engine, args.workload, args.requests, args.max_new_tokens, args.batch_size)
    details = []
    with ForwardTimer() as timer:
        for round_ in range(args.rounds + 1):
            for method in args.methods:
                getattr(engine, "forget", lambda: None)()  # each pass as a new job's (no job memory of the last)
                timer.reset()
                started = time.perf_counter()
                results = dict(engine.decode_batch(items, method, batch_size=args.batch_size))
                wall = time.perf_counter() - started
                if round_:  # the first round compiles and warms up
                    tokens = sum(len(r["output_token_ids"]) for r in results.values())
                    print(split_line(method, wall, tokens, timer), flush=True)
                    details.append(step_details(f"{method}, round {round_}", timer.steps, args.batch_size))
    print("\n" + "\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
