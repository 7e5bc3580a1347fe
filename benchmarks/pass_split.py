"""Where a pass's time goes: its prefill forwards, its decode forwards (one token a row), its verify forwards (by
width) and everything else (the loop's host work, drafting, sampling), for our engine on one workload. Forwards
are timed by wrapping the fast forward's `run` (model/fast_forward.py); the rest is the pass's wall time minus them.

Use it with peer_bench.py's `--max-new-tokens 1` (the peers' prefill alone) to tell a gap in prefill from one in
decoding.

  python benchmarks/pass_split.py                                   # 16 code edits, batch 16, ar and suffix
  python benchmarks/pass_split.py --workload summarization --requests 48 --methods ar pld

Each method runs one untimed pass (compiles, first allocations), then --rounds timed ones.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.batch_bench import WORKLOADS, hardware, workload_items  # noqa: E402
from specdec_core import Engine, EngineConfig  # noqa: E402
from specdec_core.model import fast_forward  # noqa: E402

PREFILL_FROM = 17  # a forward this many tokens a row or wider is a prefill (verify steps are narrower)


class ForwardTimer:
    """Seconds and calls of the fast forward's runs, by kind: "prefill", or "T=<tokens a row>"."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self._run = fast_forward.FastForward.run

    def __enter__(self) -> "ForwardTimer":
        timer, run = self, self._run

        def timed(forward, cache, batch, attention, real):
            started = time.perf_counter()
            try:
                return run(forward, cache, batch, attention, real)
            finally:
                width = batch.input_ids.shape[1]
                kind = "prefill" if width >= PREFILL_FROM else f"T={width}"
                timer.seconds[kind] += time.perf_counter() - started
                timer.calls[kind] += 1

        fast_forward.FastForward.run = timed
        return self

    def __exit__(self, *exc) -> None:
        fast_forward.FastForward.run = self._run

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


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
    with ForwardTimer() as timer:
        for method in args.methods:
            for round_ in range(args.rounds + 1):
                getattr(engine, "forget", lambda: None)()  # each pass as a new job's (no job memory of the last)
                timer.reset()
                started = time.perf_counter()
                results = dict(engine.decode_batch(items, method, batch_size=args.batch_size))
                wall = time.perf_counter() - started
                if round_:  # the first pass compiles and warms up
                    tokens = sum(len(r["output_token_ids"]) for r in results.values())
                    print(split_line(method, wall, tokens, timer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
