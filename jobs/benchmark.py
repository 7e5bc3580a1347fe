"""Benchmark the methods on the shipped workloads through the real pipeline, then report.

  python jobs/benchmark.py --output bench                       # ar, pld, copyspec on 4 workloads x 3 requests
  python jobs/benchmark.py --workload code_edit --per-workload 10 --method ar --method copyspec --adaptive

Reports, per method x task, the speed-up over ar on the same requests (mean of ratios and ratio of totals), the
mean accepted length and % copied; the whole-job throughput (all new tokens / job wall time) with 1 and 2 decode
actors; and HF `generate` greedy at each --hf-batch-sizes on the same requests, the best of which is the batch-job
peer. Results: OUTPUT/benchmark/{benchmark.md, benchmark.json, report.md, *.png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.reports import write_report_files
from jobs.common import report_validation_error  # noqa: E402
from pipelines.benchmark import DEFAULT_WORKLOADS, BenchmarkConfig, run_benchmark
from pipelines.generate import init_ray
from specdec_core.cli import OneLineParser, add_batch_options
from specdec_core.defaults import DEFAULT_BATCH_SIZE, DEFAULT_MODEL
from specdec_core.errors import SpecbatchError
from specdec_core.methods import MethodOptions
from specdec_core.model.model_registry import check_model_available


def _counts(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser():
    parser = OneLineParser(prog="benchmark.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="bench_outputs", help="directory for runs and results")
    parser.add_argument("--workload", action="append", dest="workloads",
                        help=f"repeatable (default: {' '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--per-workload", type=int, default=3, help="requests per workload")
    parser.add_argument("--method", action="append", dest="methods", help="repeatable (default: ar pld copyspec)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    add_batch_options(parser, DEFAULT_BATCH_SIZE, "sequences decoded at once per actor (continuous batching)")
    parser.add_argument("--actors", type=_counts, default=[1, 2], help="decode-actor counts, e.g. 1,2")
    parser.add_argument("--hf-batch-sizes", type=_counts, default=[1, 4, 16], help="e.g. 1,4,16 ('' skips the peer)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: embedded local Ray)")
    return parser


def throughput_table(result: dict) -> str:
    runs = result["pipeline_runs"]
    base = runs[0]["tokens_per_s"]
    lines = ["| job | new tokens | wall s | tok/s | x first specbatch run |", "|---|---|---|---|---|"]
    for run in runs:
        lines.append(f"| specbatch, {run['actors']} actor(s), all methods | {run['new_tokens']} | {run['wall_s']:.1f} "
                     f"| {run['tokens_per_s']:.1f} | {run['tokens_per_s'] / base:.2f} |")
    for method in result["methods_in_speedup_run"]:
        lines.append(f"| specbatch {method['method']} alone (its batched decode passes only) | {method['new_tokens']} | "
                     f"{method['decode_s']:.1f} | {method['tokens_per_s']:.1f} | {method['tokens_per_s'] / base:.2f} |")
    best = max(result["hf_generate"], key=lambda r: r["tokens_per_s"], default=None)
    for peer in result["hf_generate"]:
        mark = " (best)" if peer is best else ""
        lines.append(f"| HF generate greedy, batch {peer['batch_size']}{mark} | {peer['new_tokens']} | "
                     f"{peer['wall_s']:.1f} | {peer['tokens_per_s']:.1f} | {peer['tokens_per_s'] / base:.2f} |")
    notes = ["HF outputs identical to our ar: " + ", ".join(
        f"batch {p['batch_size']} {p['same_as_ar']}/{p['requests']}" for p in result["hf_generate"])] \
        if result["hf_generate"] else []
    return "\n".join(lines + [""] + notes)


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError


    args = build_parser().parse_args(argv)

    values = {k: v for k, v in dict(output=args.output, workloads=args.workloads, per_workload=args.per_workload,
                                    methods=args.methods, model=args.model, dtype=args.dtype,
                                    max_new_tokens=args.max_new_tokens, actors=args.actors,
                                    hf_batch_sizes=args.hf_batch_sizes, batch_size=args.batch_size,
                                    token_budget=args.token_budget,
                                    speculation_budget=args.speculation_budget).items() if v is not None}
    try:
        config = BenchmarkConfig(**values, method_options=MethodOptions(adaptive=args.adaptive,
                                                                        candidates=args.candidates))

        check_model_available(config.model)
    except (ValidationError, SpecbatchError) as exc:
        return report_validation_error("benchmark", exc)

    init_ray(args.address, output=config.output)
    result = run_benchmark(config, progress=lambda message: print(message, file=sys.stderr))
    results_dir = Path(config.output) / "benchmark"
    report, _ = write_report_files(config.output, result["speedup_run"], results_dir)
    text = report + "\n## Whole-job throughput (new tokens / wall time)\n\n" + throughput_table(result) + "\n"
    (results_dir / "benchmark.md").write_text(text, encoding="utf-8")
    (results_dir / "benchmark.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(text)
    print(f"wrote {results_dir}/benchmark.md, benchmark.json, report.md and plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
