"""The fp32 decode and verify attention (cpu_attention.py) alone: one layer's attention for a batch of rows, each
over its own cached keys, at T = 1, 2, 4 and 8 tokens a row (wider steps attend through fp32_chain_attention.py), through each of its two loops
(`decode`: the group's queries in threes against four keys, what decode steps run, T = 1 only; `wide`: two queries
against four keys, what verify steps run) and through
grouped matmuls over the padded keys (grouped_attention.py, what rows below the kernel's threshold run), and
through `cpu_attention.attend` (the loop a step picks, with the wrapper's copies: what a forward pays). Random
keys in distinct buffers per layer, so the cache is read from memory as in a real step; the candidates alternate
within each round, and the table gives medians over the rounds.

  python benchmarks/fp32_step_attention_bench.py                     # 16 rows of 1,100-1,700 keys (SmolLM2's heads)
  python benchmarks/fp32_step_attention_bench.py --rows 2 --keys 800 1200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.batch_bench import hardware  # noqa: E402
from specdec_core.kernels import cpu_attention  # noqa: E402
from specdec_core.model import grouped_attention  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--keys", type=int, nargs=2, default=(1100, 1700), metavar=("LOW", "HIGH"),
                        help="each row's cached keys, drawn in [LOW, HIGH) (default 1100 1700)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=9, help="query heads (default 9, SmolLM2's)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default 3)")
    parser.add_argument("--layers", type=int, default=12, help="distinct key/value buffers timed in turn")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads or not 0 < args.keys[0] < args.keys[1]:
        parser.error("--heads must be a multiple of --kv-heads, and --keys LOW HIGH with 0 < LOW < HIGH")
    kernels = cpu_attention.kernel()
    if kernels is None:
        print(f"the compiled attention is unavailable: {cpu_attention.kernel.unavailable}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    widest = grouped_attention.MAX_QUERIES
    capacity = args.keys[1] + widest
    shape = (args.rows, args.kv_heads, capacity, args.head_dim)
    keys = [torch.randn(shape) for _ in range(args.layers)]
    values = [torch.randn(shape) for _ in range(args.layers)]
    lengths = torch.randint(args.keys[0], args.keys[1], (args.rows,))
    group, scale = args.heads // args.kv_heads, args.head_dim ** -0.5
    print(f"{hardware('cpu')}; fp32; {args.rows} rows of {args.keys[0]}-{args.keys[1]} keys, head_dim "
          f"{args.head_dim}, {args.heads} heads over {args.kv_heads} kv heads; ms per layer, median of {args.rounds}")
    print("| T | decode | wide | attend | grouped | wide / decode | grouped / attend |\n|---|---|---|---|---|---|---|")
    for num_new in (1, 2, 4, widest):
        counts = lengths + num_new
        kv_len = int(counts.max())
        position = torch.arange(kv_len)[None, None, :]
        allowed = position < lengths[:, None, None] + torch.arange(num_new)[None, :, None] + 1  # [b, T, L]
        mask = torch.zeros(args.rows, 1, num_new, kv_len).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        query = torch.randn(args.rows, args.heads, num_new, args.head_dim)
        q = query.reshape(args.rows, args.kv_heads, group, num_new, args.head_dim).contiguous().numpy()
        flat_mask = mask[:, 0].contiguous().numpy()
        queries = np.full(args.rows, num_new, dtype=np.int64)
        out = np.empty_like(q)

        def loop(index):
            def run(layer):
                kernels[index](q, keys[layer].numpy(), values[layer].numpy(), counts.numpy().astype(np.int64),
                               queries, flat_mask, np.float32(scale), out)
            return run

        def grouped(layer):
            grouped_attention.grouped_attention_forward(None, query, keys[layer][:, :, :kv_len],
                                                        values[layer][:, :, :kv_len], mask, scaling=scale)

        def attend(layer):
            cpu_attention.attend(query, keys[layer][:, :, :kv_len], values[layer][:, :, :kv_len], counts, mask, scale)

        candidates = {"decode": loop(0), "wide": loop(1), "attend": attend, "grouped": grouped}
        if num_new > 1:  # the decode loop computes one query a row
            del candidates["decode"]
        times = {name: [] for name in candidates}
        for run in candidates.values():
            run(0)  # compiles on first use
        for round_ in range(args.rounds):
            turn = round_ % len(candidates)
            for name in list(candidates)[turn:] + list(candidates)[:turn]:
                start = time.perf_counter()
                for layer in range(args.layers):
                    candidates[name](layer)
                times[name].append((time.perf_counter() - start) / args.layers * 1e3)
        ms = {name: statistics.median(values) for name, values in times.items()}
        decode = f"{ms['decode']:.2f}" if "decode" in ms else "-"
        ratio = f"{ms['wide'] / ms['decode']:.2f}" if "decode" in ms else "-"
        print(f"| {num_new} | {decode} | {ms['wide']:.2f} | {ms['attend']:.2f} | {ms['grouped']:.2f} | {ratio} | "
              f"{ms['grouped'] / ms['attend']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
