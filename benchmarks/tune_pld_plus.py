"""Tune PLD+ (h) on the default model: mean accepted length (and tok/s) of `pld_plus_h` for each hidden layer l,
draft length K and threshold θ, beside plain `pld`, on the shipped workloads (one run, side by side).

  python benchmarks/tune_pld_plus.py --workload code_edit summarization --requests 16 --layers 2 5 9 14 20 \
      --tokens 10 20 --thresholds none 0.0 0.5

As the paper (§5.5) tunes on average acceptance length, drafts are verified as proposed (no speculation budget);
mean accepted length = new tokens / target forwards (prefill included, ar = 1.0).

The paper's comparison (§5.2-5.4) runs its PLD baseline at Spec-Bench's default draft length (10 tokens) and PLD+ at
its tuned K (70). `--pld-baseline-tokens 10` reproduces that protocol: every row is also compared with pld at 10
tokens ("x pld base"), beside pld at the row's own K ("x pld same K"), which separates what the ranking adds from what
the longer draft adds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.batch_bench import WORKLOADS, hardware, workload_items  # noqa: E402
from specdec_core.engine import Engine, EngineConfig
from specdec_core.methods import MethodOptions


def run(engine, items, method: str, options, batch_size: int) -> dict:
    decoder = engine.decoder(batch_size, speculation_budget=False)
    for item in items:
        decoder.submit(engine.request(item, method, options, decoder))
    started = time.perf_counter()
    got = [r for _, r in engine.results(decoder, method)]
    wall = time.perf_counter() - started
    ok = [r for r in got if not r.get("error")]
    new = sum(r["new_tokens"] for r in ok)
    return {"new_tokens": new, "tok_s": new / wall, "mal": new / max(1, sum(r["target_forwards"] for r in ok)),
            "errors": len(got) - len(ok)}


def main() -> int:
    import torch


    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=["code_edit", "summarization"], choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 5, 9, 14, 20])
    parser.add_argument("--tokens", type=int, nargs="+", default=[10], help="draft lengths K")
    parser.add_argument("--thresholds", nargs="+", default=["0.0"], help="θ values; 'none' = no threshold")
    parser.add_argument("--pld-baseline-tokens", type=int, default=None,
                        help="also compare every row with pld at this draft length (the paper's PLD: 10)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="a registry name or HF directory (default: the default model)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(dtype=args.dtype, **({"model": args.model} if args.model else {})))
    print(f"# {engine.config.model}, dtype {engine.target.dtype_name}, {hardware(engine.target.device)}, "
          f"{engine.target.num_layers} layers, {args.requests} requests, {args.max_new_tokens} new tokens, "
          f"batch {args.batch_size}, no speculation budget, one run", flush=True)
    print("| workload | method | layer | K | θ | mean accepted length | x pld same K | x pld base | tok/s | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    thresholds = [None if t == "none" else float(t) for t in args.thresholds]
    for workload in args.workload:
        items = workload_items(engine, workload, args.requests, args.max_new_tokens, args.batch_size)
        plain = {}  # K -> pld's run at K
        baseline_k = args.pld_baseline_tokens
        for k in sorted(set(args.tokens) | ({baseline_k} if baseline_k else set())):
            plain[k] = run(engine, items, "pld", MethodOptions(lookup_tokens=k), args.batch_size)
        for k in args.tokens:
            base = plain[baseline_k or k]
            print(f"| {workload} | pld | | {k} | | {plain[k]['mal']:.3f} | 1.00 | "
                  f"{plain[k]['mal'] / base['mal']:.2f} | {plain[k]['tok_s']:.1f} | {plain[k]['errors']} |", flush=True)
            for layer in args.layers:
                for theta in thresholds:
                    options = MethodOptions(lookup_tokens=k, hidden_layer=layer, similarity_threshold=theta)
                    got = run(engine, items, "pld_plus_h", options, args.batch_size)
                    print(f"| {workload} | pld_plus_h | {layer} | {k} | {theta} | {got['mal']:.3f} | "
                          f"{got['mal'] / plain[k]['mal']:.2f} | {got['mal'] / base['mal']:.2f} | "
                          f"{got['tok_s']:.1f} | {got['errors']} |", flush=True)
        if baseline_k and baseline_k not in args.tokens:
            print(f"| {workload} | pld (base) | | {baseline_k} | | {plain[baseline_k]['mal']:.3f} | 1.00 | 1.00 | "
                  f"{plain[baseline_k]['tok_s']:.1f} | {plain[baseline_k]['errors']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
