"""Engine benchmark: our methods and HF `generate` peers, side by side in one run, on code edits and summaries.

HF peers run on the same loaded model object (same weights, same CPU tuning), so the ratios compare decoding
algorithms, not kernels. Prints, per task and method: tokens/s (total new tokens / total wall), speed-up over our `ar` (mean of per-request
ratios and ratio of totals), mean accepted length, % copied, outputs identical to `ar`. Then the CopySpec index
micro-benchmark (per-step cost from 1k to 100k history tokens, memory at 100k).

  python benchmarks/engine_bench.py                      # full run (about 30 min on 2 cores)
  python benchmarks/engine_bench.py --code 2 --summaries 2 --max-new-tokens 64   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from corpora.aclsum import summarization_rows  # noqa: E402
from corpora.code_edit import stdlib_rename_tasks  # noqa: E402
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402
from specdec_core.drafters.copyspec_index import CopyIndex  # noqa: E402
from specdec_core.drafters.prompt_lookup import find_prompt_lookup_draft  # noqa: E402
from specdec_core.engine import Engine, EngineConfig  # noqa: E402
from specdec_core.loop.requests import DecodeParams  # noqa: E402
from specdec_core.methods import MethodOptions  # noqa: E402

# label -> (method, options); HF peers are labelled hf_*
OUR_METHODS = {
    "ar": ("ar", MethodOptions()),
    "pld": ("pld", MethodOptions()),
    "copyspec": ("copyspec", MethodOptions()),
    "copyspec(m=32)": ("copyspec", MethodOptions(copy_tokens=32)),
    "copyspec(adaptive)": ("copyspec", MethodOptions(adaptive=True)),
}
PEERS = ("hf_greedy", "hf_prompt_lookup")


def run_hf(engine: Engine, ids: list[int], max_new: int, prompt_lookup: int | None) -> dict:
    model = engine.target.model
    input_ids = torch.tensor([ids])
    kwargs = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                             do_sample=False, temperature=None, top_p=None, top_k=None, **kwargs)
    wall = time.perf_counter() - started
    new = out[0, len(ids):].tolist()
    return {"output_token_ids": new, "new_tokens": len(new), "wall_s": wall, "target_forwards": None,
            "copied_tokens": None}


def run_ours(engine: Engine, ids: list[int], max_new: int, method: str, options: MethodOptions) -> dict:
    return engine.generate_ids(ids, method, DecodeParams(max_new_tokens=max_new), options)


def bench_requests(engine: Engine, tasks: list[dict], max_new: int, labels: list[str]) -> dict:
    """Every method on every request, interleaved per request so machine noise hits all methods alike."""
    results: dict[str, list[dict]] = defaultdict(list)
    for n, task in enumerate(tasks):
        ids = engine.prompt_ids(task["prompt"])
        for label in labels:
            if label == "hf_greedy":
                r = run_hf(engine, ids, max_new, None)
            elif label == "hf_prompt_lookup":
                r = run_hf(engine, ids, max_new, 10)
            else:
                r = run_ours(engine, ids, max_new, *OUR_METHODS[label])
            r["request_id"] = task["id"]
            results[label].append(r)
        ar = results["ar"][-1]
        print(f"  [{task['task']} {n + 1}/{len(tasks)}] {task['id']}: prompt {len(ids)} tok, ar {ar['new_tokens']} "
              f"tok at {ar['new_tokens'] / ar['wall_s']:.1f} tok/s", flush=True)
    return results


def summarize(results: dict) -> list[dict]:
    ar = results["ar"]
    rows = []
    for label, runs in results.items():
        ratios = [(r["new_tokens"] / r["wall_s"]) / (a["new_tokens"] / a["wall_s"]) for r, a in zip(runs, ar)]
        new = sum(r["new_tokens"] for r in runs)
        wall = sum(r["wall_s"] for r in runs)
        forwards = [r["target_forwards"] for r in runs]
        copied = [r["copied_tokens"] for r in runs]
        rows.append({
            "method": label,
            "tokens_per_s": new / wall,
            "speedup_mean": statistics.mean(ratios),
            "speedup_total": (new / wall) / (sum(a["new_tokens"] for a in ar) / sum(a["wall_s"] for a in ar)),
            "mean_accepted_length": new / sum(forwards) if None not in forwards else None,
            "pct_copied": 100 * sum(copied) / new if None not in copied else None,
            "identical_to_ar": sum(r["output_token_ids"] == a["output_token_ids"] for r, a in zip(runs, ar)),
            "requests": len(runs),
            "new_tokens": new,
        })
    return rows


def print_table(task: str, rows: list[dict]) -> None:
    print(f"\n== {task}: tokens/s, speed-up over ar (mean of per-request ratios / ratio of totals) ==")
    print(f"{'method':22s} {'tok/s':>7s} {'x ar(mean)':>10s} {'x ar(tot)':>9s} {'acc.len':>7s} {'%copied':>7s} "
          f"{'same as ar':>10s}")
    for r in rows:
        acc = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        cop = "-" if r["pct_copied"] is None else f"{r['pct_copied']:.0f}"
        print(f"{r['method']:22s} {r['tokens_per_s']:7.1f} {r['speedup_mean']:10.2f} {r['speedup_total']:9.2f} "
              f"{acc:>7s} {cop:>7s} {r['identical_to_ar']:>4d}/{r['requests']}")


def micro_copyspec(sizes=(1_000, 10_000, 100_000), steps=2_000, gamma=3) -> list[dict]:
    """Per-step cost of CopySpec (append one token + look up + copy) vs prompt lookup's rescan, by history size."""
    rng = random.Random(0)
    rows = []
    for size in sizes:
        # Text-like history: random tokens with repeated spans, so lookups hit as well as miss.
        history = [rng.randrange(49_152) for _ in range(size // 2)]
        while len(history) < size + steps:
            start = rng.randrange(len(history) - 40)
            history += history[start:start + rng.randrange(5, 40)] + [rng.randrange(49_152) for _ in range(5)]
        tracemalloc.start()
        index = CopyIndex(gamma)
        index.extend(history[:size])
        memory_mb = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        started = time.perf_counter()
        for token in history[size:size + steps]:
            index.append(token)
            index.copy_candidate(10)
        copyspec_ms = (time.perf_counter() - started) / steps * 1e3
        arr = np.array(history[:size + 100], dtype=np.int64)
        pld_steps = 50
        started = time.perf_counter()
        for i in range(pld_steps):
            find_prompt_lookup_draft(arr[: size + i], 3, 1, 10)
        pld_ms = (time.perf_counter() - started) / pld_steps * 1e3
        rows.append({"history_tokens": size, "copyspec_ms_per_step": copyspec_ms, "index_memory_mb": memory_mb,
                     "prompt_lookup_ms_per_step": pld_ms})
    print("\n== CopySpec index: per-step lookup+update vs history size (prompt lookup rescan for contrast) ==")
    for r in rows:
        print(f"history {r['history_tokens']:>7d}: copyspec {r['copyspec_ms_per_step']:.4f} ms/step, "
              f"index {r['index_memory_mb']:.1f} MB; prompt lookup {r['prompt_lookup_ms_per_step']:.3f} ms/step")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto",
                        help="auto = bf16 on CPUs with native bf16 (avx512_bf16/AMX), else fp32 (bf16 is emulated "
                             "there and a multi-token forward costs 4x a one-token one)")
    parser.add_argument("--code", type=int, default=10, help="code-edit prompts (stdlib renames)")
    parser.add_argument("--summaries", type=int, default=10, help="ACLSum summarization prompts")
    parser.add_argument("--max-new-tokens", type=int, default=0, help="override both task budgets")
    parser.add_argument("--code-tokens", type=int, default=320)
    parser.add_argument("--summary-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of: {', '.join(list(OUR_METHODS) + list(PEERS))} (ar is always run)")
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/engine_bench.json")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu"))
    labels = list(OUR_METHODS) + list(PEERS)
    if args.methods:
        chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in chosen if m not in labels]
        if unknown:
            parser.error(f"unknown method(s): {', '.join(unknown)}")
        labels = ["ar"] + [m for m in chosen if m != "ar"]
    print(f"model {args.model} {engine.target.dtype_name}, {args.threads} threads, methods: {', '.join(labels)}")
    engine.generate("Warm up.", params=DecodeParams(max_new_tokens=8))

    report = {"model": args.model, "dtype": engine.target.dtype_name, "threads": args.threads, "tasks": {}}
    workloads = {
        "code_edit": (stdlib_rename_tasks(args.code), args.max_new_tokens or args.code_tokens),
        "summarization": (summarization_rows(args.summaries), args.max_new_tokens or args.summary_tokens),
    }
    for task, (tasks, max_new) in workloads.items():
        if not tasks:
            continue
        print(f"\n{task}: {len(tasks)} prompts, max_new_tokens={max_new}")
        rows = summarize(bench_requests(engine, tasks, max_new, labels))
        report["tasks"][task] = rows
        print_table(task, rows)
    if not args.skip_micro:
        report["copyspec_micro"] = micro_copyspec()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
