"""The bf16 step attention alone: one layer's decode and verify attention for a batch of rows, each over its own
cached keys, at 1, 3, 5 and 9 tokens a row and a ragged step (9 tokens on a quarter of the rows, 1 on the others),
through bf16_step_attention.py's two kernels (`attend`, and `attend_exact` of --deterministic) and, on an AMX CPU at
head_dim 64, amx_step_attention.py. Random keys in distinct buffers per layer, so the cache is read from memory as
in a real step.

  python benchmarks/step_attention_bench.py                        # 16 rows of 1,100-1,700 keys, head_dim 64
  python benchmarks/step_attention_bench.py --keys 100 300 --head-dim 128 --heads 4 --kv-heads 2

Prints ms per layer (best of the rounds) and each width's cost over a decode step's (T = 1): what a verify of T
tokens costs the attention. Needs a CPU with AVX512_BF16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.batch_bench import hardware  # noqa: E402
from specdec_core.kernels import amx_step_attention, bf16_step_attention  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="rows of the batch (default 16)")
    parser.add_argument("--keys", type=int, nargs=2, default=(1100, 1700), metavar=("LOW", "HIGH"),
                        help="each row's cached keys, drawn in [LOW, HIGH) (default 1100 1700)")
    parser.add_argument("--head-dim", type=int, default=64, choices=bf16_step_attention.HEAD_DIMS)
    parser.add_argument("--heads", type=int, default=9, help="query heads (default 9, SmolLM2's)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default 3)")
    parser.add_argument("--layers", type=int, default=30, help="distinct key/value buffers timed in turn")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not bf16_step_attention.usable(args.head_dim):
        print("the bf16 step attention does not run on this CPU (it needs AVX512_BF16)", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads or not 0 < args.keys[0] < args.keys[1]:
        parser.error("--heads must be a multiple of --kv-heads, and --keys LOW HIGH with 0 < LOW < HIGH")
    torch.manual_seed(0)
    capacity = args.keys[1] + 16
    shape = (args.rows, args.kv_heads, capacity, args.head_dim)
    keys = [torch.randn(shape).bfloat16() for _ in range(args.layers)]
    values = [torch.randn(shape).bfloat16() for _ in range(args.layers)]
    lengths = torch.randint(args.keys[0], args.keys[1], (args.rows,))
    slots = torch.arange(args.rows)
    print(f"{hardware('cpu')}; bf16; {args.rows} rows of {args.keys[0]}-{args.keys[1]} keys, head_dim "
          f"{args.head_dim}, {args.heads} heads over {args.kv_heads} kv heads; ms per layer, best of {args.rounds}")
    base = {}
    for name, num_new, ragged in (("T = 1", 1, False), ("T = 3", 3, False), ("T = 5", 5, False), ("T = 9", 9, False),
                                  ("T = 9 on 1/4 of rows, 1 on the rest", 9, True)):
        visible = torch.ones(args.rows, num_new, num_new, dtype=torch.bool).tril()
        if ragged:  # a verify step's width is its longest draft's: the other rows feed their pending token only
            visible[[r for r in range(args.rows) if r % 4], 1:] = False
        query = torch.randn(args.rows, args.heads, num_new, args.head_dim).bfloat16()
        line = [f"{name}:"]
        kernels = {"attend": bf16_step_attention.Step(visible, lengths, slots),
                   "exact": bf16_step_attention.Step(visible, lengths, slots, exact=True)}
        if amx_step_attention.usable(args.head_dim):
            kernels["amx"] = amx_step_attention.Step(visible, lengths, slots)
        for label, step in kernels.items():
            step.attend(query, keys[0], values[0], args.head_dim ** -0.5)  # compiles on first use
            best = float("inf")
            for _ in range(args.rounds):
                start = time.perf_counter()
                for layer in range(args.layers):
                    step.attend(query, keys[layer], values[layer], args.head_dim ** -0.5)
                best = min(best, (time.perf_counter() - start) / args.layers * 1e3)
            base.setdefault(label, best)
            line.append(f"{label} {best:.3f} ms ({best / base[label]:.2f}x T = 1)")
        print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
