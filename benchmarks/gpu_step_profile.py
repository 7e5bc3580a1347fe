"""Where a graph-ready step's GPU time goes (issue 50): the step of a random model of a real shape, run under
torch.profiler, its kernels grouped by name and by kind (matrix products, attention, cache writes, the rest), with
their count and GPU time a step. A captured step's time is about the sum of its kernels' times: this says which to
fuse or replace. Each `--modes` entry is a GraphStep mode run without its graph (the kernels are the ones its graph
replays; the profiler then sees each launch), and `captured` also profiles the graph's replays.

  python benchmarks/gpu_step_profile.py                                   # a GPU: Qwen2.5-1.5B shape, batch 64, T 1
  python benchmarks/gpu_step_profile.py --device cpu --dtype float32 --shape tiny --batch-size 2 --context 40
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.gpu_step_roofline import chain_step, filled_cache, step_bytes, copy_bandwidth, timed  # noqa: E402
from benchmarks.host_overhead_bench import SHAPES, shaped_model  # noqa: E402
from specdec_core.loop.verification import accept_greedy_nodes  # noqa: E402
from specdec_core.model.graph_step import GraphStep  # noqa: E402
from specdec_core.model.model_runner import ModelRunner  # noqa: E402
from tests.tiny_models import DigitsTokenizer  # noqa: E402

KINDS = (  # (kind, substrings of a kernel's name), first match wins
    ("attention", ("fmha", "attention", "flash", "flex", "efficient", "sdpa")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas", "splitk", "mm_", "addmm")),
    ("cache write", ("index_put", "scatter", "indexing_backward")),
    ("copy", ("copy", "cat", "elementwise_kernel_with_index")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "fused/other" if lowered.startswith("triton") else "elementwise/other"


def device_kernels(prof) -> list[tuple[str, float]]:
    """(name, GPU microseconds) of every kernel the profiler saw."""
    kernels = []
    for event in prof.events():
        device_type = getattr(event, "device_type", None)
        if device_type is not None and "CUDA" in str(device_type) and event.device_time_total > 0:
            kernels.append((event.name, event.device_time_total))
    if not kernels:  # a CPU: the operators' own times stand in
        kernels = [(event.name, event.self_cpu_time_total) for event in prof.events() if event.name.startswith("aten")]
    return kernels


def profile_steps(run, steps: int, device: str, table: Path | None) -> list[tuple[str, float]]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    for _ in range(2):
        run()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    if table is not None:  # the profiler's own table too, in case a kernel's event reads differently elsewhere
        sort = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
        with table.open("a") as out:
            out.write(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
    return device_kernels(prof)


def summarize(label: str, kernels: list[tuple[str, float]], steps: int, step_ms: float, top: int) -> dict:
    by_name, by_kind = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        for table, key in ((by_name, name), (by_kind, kind_of(name))):
            table[key][0] += 1
            table[key][1] += us
    total_us = sum(us for _, us in kernels) / steps
    print(f"\n{label}: {len(kernels) / steps:.0f} kernels a step, {total_us / 1e3:.3f} ms of kernel time a step, "
          f"{step_ms:.3f} ms a step timed alone")
    for kind, (count, us) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
        print(f"  {kind:>18}: {count / steps:6.0f} kernels  {us / steps / 1e3:8.3f} ms  "
              f"{100 * us / max(1e-9, total_us * steps):5.1f} %")
    rows = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    for name, (count, us) in rows:
        print(f"    {us / steps:9.1f} us  x{count / steps:<5.0f} {us / count:7.2f} us each  {name[:110]}")
    return {"label": label, "kernels_per_step": len(kernels) / steps, "kernel_ms_per_step": total_us / 1e3,
            "step_ms": step_ms,
            "kinds": {k: {"kernels": c / steps, "ms": u / steps / 1e3} for k, (c, u) in by_kind.items()},
            "top": [{"name": n, "kernels": c / steps, "us": u / steps} for n, (c, u) in rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=["tiny", *SHAPES])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--widths", nargs="+", type=int, default=[1])
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--modes", nargs="+", default=["captured", "compiled"], choices=["captured", "compiled"])
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (the table is per step)")
    parser.add_argument("--top", type=int, default=18, help="kernel names listed")
    parser.add_argument("--out", default=None, help="the summaries as JSON")
    parser.add_argument("--tables", default=None, help="the profiler's own tables, appended to this file")
    args = parser.parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    model = shaped_model(args.shape, device, dtype)
    runner = ModelRunner(model, DigitsTokenizer(), f"random {args.shape}", device, dtype, fast_forward=True)
    runner.gpu_attention = "sdpa"
    bandwidth = copy_bandwidth(device)
    lengths = [args.context + (row * 37) % max(1, args.context // 8) for row in range(args.batch_size)]
    summaries = []
    tables = Path(args.tables) if args.tables else None
    print(f"{args.shape} b{args.batch_size}, {args.dtype}, torch {torch.__version__}, copy {bandwidth / 1e9:.0f} GB/s")
    for width in args.widths:
        cache = filled_cache(runner, lengths, width)
        batch, step_ids = chain_step(lengths, width, runner.vocab_size, seed=width)
        roofline_ms = step_bytes(runner, lengths, width) / bandwidth * 1e3
        print(f"T{width}: roofline {roofline_ms:.3f} ms")
        for mode in args.modes:
            step = GraphStep(runner, mode)
            capture = step.capture
            step.capture = False  # the kernels without the graph: the profiler sees each
            run = (lambda step=step: step.run(cache, batch, step_ids, accept_greedy_nodes))
            step_ms = timed(run, device, 10)[0]
            summaries.append(summarize(f"{mode} (unreplayed) T{width}", profile_steps(run, args.steps, device, tables),
                                       args.steps, step_ms, args.top))
            if capture and device.startswith("cuda"):
                step.capture = True
                step_ms = timed(run, device, 10)[0]
                kernels = profile_steps(run, args.steps, device, tables)
                summaries.append(summarize(f"{mode} (graph replays) T{width}", kernels, args.steps, step_ms, args.top))
        del cache
    if args.out:
        Path(args.out).write_text(json.dumps(summaries, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
