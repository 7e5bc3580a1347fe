"""--deterministic in bf16: do lossless methods give batch-1 `ar`'s exact tokens, and what does the switch
cost? Side by side in one process.

  python benchmarks/deterministic_bench.py --workload summarization code_edit --requests 32 --batch-sizes 1 4 16

1. Exactness. One engine with --deterministic: per workload, `ar` at batch 1 is the reference; every method at every
   batch size counts the rows whose tokens equal it (the target: all of them).
2. Cost. A second engine without the switch, same model and dtype: `ar` and --cost-methods at --cost-batch run on
   both, interleaved for --rounds rounds; each round prints deterministic tok/s / plain tok/s. Without the switch
   the rows of the same table show how many a plain bf16 engine gets right (near-ties flip between step shapes).
Records the CPU flags, dtype and threads. On an AVX2-only CPU, --dtype auto is fp32, where both engines are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.batch_bench import (  # noqa: E402
    WORKLOADS,
    hardware,
    method_sizes,
    parse_method,
    run_ours,
    warm_up,
    workload_items,
)
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402
from specdec_core.engine import Engine, EngineConfig

LOSSLESS = ["pld", "copyspec", "copyspec:candidates=3", "casd_strict", "spectra", "suffix", "auto", "draft", "slem"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, default=["summarization", "code_edit"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--methods", nargs="+", default=LOSSLESS, help="NAME[:option=value,...][@SIZES]")
    parser.add_argument("--cost-methods", nargs="*", default=["copyspec"], help="timed with and without the switch")
    parser.add_argument("--cost-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the cost comparison")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--drafter", default=DEFAULT_MODEL, help="the draft model of `draft` and `slem`")
    parser.add_argument("--json", default=None)
    return parser


def same_rows(outputs: dict, reference: dict, items) -> int:
    """Rows whose tokens equal the reference's (a row that failed in either run never counts)."""
    return sum(outputs[i.key] is not None and outputs[i.key] == reference[i.key] for i in items)


def exactness(engine, items, methods: list[str], batch_sizes: list[int], reference: dict) -> list[dict]:
    rows = []
    for text in methods:
        for size in method_sizes(text, batch_sizes):
            outputs: dict = {}
            result = run_ours(engine, items, text, size, None, outputs=outputs)
            result["same_as_ar_b1"] = same_rows(outputs, reference, items)
            result["tokens_per_s"] = result["new_tokens"] / result["wall_s"]
            rows.append(result)
            print(json.dumps({"part": "exactness", **result}), flush=True)
    return rows


def cost(engines: dict, items, methods: list[str], size: int, rounds: int, reference: dict) -> list[dict]:
    rows = []
    for round_number in range(1, rounds + 1):
        for text in methods:
            for mode, engine in engines.items():
                outputs: dict = {}
                result = run_ours(engine, items, text, size, None, outputs=outputs)
                result.update(mode=mode, round=round_number, tokens_per_s=result["new_tokens"] / result["wall_s"],
                              same_as_ar_b1=same_rows(outputs, reference, items))
                rows.append(result)
                print(json.dumps({"part": "cost", **result}), flush=True)
    return rows


def exactness_table(rows: list[dict], requests: int) -> str:
    lines = ["| method | batch | = ar batch 1 | tok/s |", "|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['batch_size']} | {r['same_as_ar_b1']}/{requests} | {r['tokens_per_s']:.1f} |"
              for r in rows]
    return "\n".join(lines)


def cost_table(rows: list[dict], requests: int) -> str:
    lines = ["| method | batch | tok/s deterministic per round | tok/s plain per round | x plain per round | median |"
             " = ar batch 1 (det / plain) |", "|---|---|---|---|---|---|---|"]
    for system in dict.fromkeys(r["system"] for r in rows):
        det = [r for r in rows if r["system"] == system and r["mode"] == "deterministic"]
        plain = [r for r in rows if r["system"] == system and r["mode"] == "plain"]
        ratios = [d["tokens_per_s"] / p["tokens_per_s"] for d, p in zip(det, plain)]
        speeds = [", ".join(f"{r['tokens_per_s']:.1f}" for r in runs) for runs in (det, plain)]
        lines.append(f"| {system} | {det[0]['batch_size']} | {speeds[0]} | {speeds[1]} | "
                     f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} | "
                     f"{det[0]['same_as_ar_b1']}/{requests} / {plain[0]['same_as_ar_b1']}/{requests} |")
    return "\n".join(lines)


def main() -> int:
    import torch


    args = build_parser().parse_args()
    for text in args.methods + args.cost_methods:
        parse_method(text)  # a bad method option fails before the models load
    torch.set_num_threads(os.cpu_count() or 1)
    config = EngineConfig(model=args.model, dtype=args.dtype, drafter=args.drafter, deterministic="off")
    engines = {"deterministic": Engine(EngineConfig(**{**vars(config), "deterministic": "on"})),
               "plain": Engine(config) if args.rounds > 0 else None}  # the cost rounds time ar at least
    engines = {mode: engine for mode, engine in engines.items() if engine is not None}
    det = engines["deterministic"]
    header = (f"{args.model}, drafter {args.drafter}, dtype {det.target.dtype_name}, {hardware('cpu')}, "
              f"{args.requests} requests per workload, {args.max_new_tokens} new tokens")
    print(f"# {header}", flush=True)
    report = {"header": header, "workloads": {}}
    for workload in args.workload:
        items = workload_items(det, workload, args.requests, args.max_new_tokens, max(args.batch_sizes))
        if workload == args.workload[0]:
            for engine in engines.values():
                warm_up(engine, items, ["ar"] + args.methods + args.cost_methods, batch_size=max(args.batch_sizes))
        reference: dict = {}
        started = time.perf_counter()
        run_ours(det, items, "ar", 1, None, outputs=reference)
        print(f"# {workload}: reference ar at batch 1 in {time.perf_counter() - started:.0f} s", flush=True)
        rows = exactness(det, items, args.methods, args.batch_sizes, reference)
        timed = cost(engines, items, ["ar"] + args.cost_methods, args.cost_batch, args.rounds, reference) \
            if "plain" in engines else []
        report["workloads"][workload] = {"exactness": rows, "cost": timed}
        print(f"\n## {workload} ({len(items)} requests): rows equal to --deterministic ar at batch 1\n\n"
              f"{exactness_table(rows, len(items))}\n", flush=True)
        if timed:
            print(f"Cost of the switch, batch {args.cost_batch}, interleaved:\n\n{cost_table(timed, len(items))}\n",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
