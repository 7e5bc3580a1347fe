"""The bf16 dot-product linear kernel with its weights streamed from memory, as a decode step reads them: 30 layers
of SmolLM2-135M's four linears (qkv, o, gate_up, down; ~212 MB of distinct random weights, far more than the
caches) at each row count, two ways side by side in one process, alternating:

- kernel: bf16_dot_kernel.matmul's dispatch as it is (1-8 and 13-16 rows: one pass over each panel alone);
- panel pairs: the same with no one-panel pass for 1-8 rows, which then run in blocks of 8 rows x 2 panels and the
  rows left over (what they ran before; 13-16 rows keep their own pass in both).
Both are compiled in this process the same way: a cached kernel against a fresh compile read ~10 % apart at a row
count where the two run the same code.

  python benchmarks/streamed_linear_bench.py                      # rows 1 2 4 8 10 16 24
  python benchmarks/streamed_linear_bench.py --rows 2 --rounds 9

Prints ms for the 30 layers (best of the rounds), the weights' GB/s and GFLOP/s, and the median over the rounds
of panel pairs' time over the kernel's in the same round. Needs a CPU
with AVX512_BF16. Both ways give the same bits (tests/specdec_core/test_panel_linear.py checks row invariance).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.batch_bench import hardware  # noqa: E402
from specdec_core.kernels import bf16_dot, bf16_dot_kernel as dot_kernel  # noqa: E402 (imports numba)

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # SmolLM2-135M's qkv, o, gate_up, down: [out, in]


def dispatch(few_rows: int):
    """The kernel's own dispatch compiled here (not from the cache, so both ways are compiled alike), with `few_rows`
    for FEW_ROWS: the kernel's value, or 0 for what 1-8 rows ran before (panel pairs)."""
    from numba import njit

    source = dot_kernel.matmul.py_func
    return njit(parallel=True)(types.FunctionType(source.__code__, {**source.__globals__, "FEW_ROWS": few_rows}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 10, 16, 24])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.layers < 1 or args.rounds < 1:
        parser.error("--rows, --layers and --rounds must be >= 1")
    if not bf16_dot.available():
        print("needs a CPU with AVX512_BF16 (the bf16 dot-product kernel)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    layers = [bf16_dot.as_words(bf16_dot.to_pair_panels((torch.randn(out, inp) * 0.05).to(torch.bfloat16)))
              for _ in range(args.layers) for out, inp in SHAPES]  # uint32 [P, in / 2, 16] each
    weight_bytes = sum(out * inp * 2 for out, inp in SHAPES) * args.layers
    bf16_dot.kernel()  # compiles the kernel's pieces (the row passes) the dispatches call
    ways = {"kernel": dispatch(dot_kernel.FEW_ROWS), "panel pairs": dispatch(0)}
    print(f"# {hardware('cpu')}; {args.layers} layers of SmolLM2-135M's linears, "
          f"{weight_bytes / 1e6:.0f} MB of bf16 weights; best of {args.rounds} rounds (the ratio: the median of "
          "each round's)")
    print("| rows | kernel ms | GB/s | GFLOP/s | panel pairs ms | GB/s | panel pairs / kernel |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        inputs = {inp: torch.randn(rows, inp).to(torch.bfloat16).view(torch.int32).numpy().view(np.uint32)
                  for inp in {inp for _, inp in SHAPES}}  # [rows, in / 2] bf16 pairs
        outs = [np.empty((rows, panels.shape[0] * 16), dtype=np.float32) for panels in layers]
        best = {}
        for name, matmul in ways.items():  # compiled for this signature before timing
            matmul(inputs[SHAPES[0][1]], layers[0], outs[0])
            best[name] = float("inf")
        ratios = []  # panel pairs / kernel in each round: the machine drifts between rounds, less within one
        for round_ in range(args.rounds):
            seconds = {}
            for name in (list(ways) if round_ % 2 == 0 else list(ways)[::-1]):
                started = time.perf_counter()
                for panels, out in zip(layers, outs):
                    ways[name](inputs[panels.shape[1] * 2], panels, out)
                seconds[name] = time.perf_counter() - started
                best[name] = min(best[name], seconds[name])
            ratios.append(seconds["panel pairs"] / seconds["kernel"])
        kernel, pairs = best["kernel"], best["panel pairs"]
        gflop = 2 * rows * weight_bytes / 2 / 1e9
        print(f"| {rows} | {kernel * 1e3:.2f} | {weight_bytes / kernel / 1e9:.1f} | {gflop / kernel:.0f} | "
              f"{pairs * 1e3:.2f} | {weight_bytes / pairs / 1e9:.1f} | {statistics.median(ratios):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
