"""Batched decoding vs HF `generate` greedy, side by side in one run (no Ray): job throughput per batch size.

  python benchmarks/batch_bench.py --workload code_edit --requests 32 --batch-sizes 1 4 8 16 32 \
      --methods ar copyspec pld copyspec:candidates=3 copyspec:adaptive

Prints one line per (system, batch size): new tokens, wall s, tok/s, ratio to HF at the same batch size and to the
best HF batch size, and how many outputs equal HF's (exact in fp32; bf16 near-ties may flip). Records the CPU flags
and the dtype. Single-turn prompts only (multi-turn rows use their first turn).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def cpu_flags() -> str:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "?"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags)


def parse_method(text: str):
    from specdec_core.methods import MethodOptions

    name, _, extra = text.partition(":")
    options = {}
    for part in filter(None, extra.split(",")):
        key, _, value = part.partition("=")
        options[key] = True if value == "" else int(value)
    return name, MethodOptions(**options)


def main() -> int:
    import torch

    from operators.read_requests import workload_rows
    from pipelines.hf_batch_peer import generate_batch
    from specdec_core.decode import DecodeParams
    from specdec_core.engine import BatchItem, Engine, EngineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="code_edit")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--methods", nargs="+", default=["ar", "copyspec", "pld", "copyspec:candidates=3",
                                                         "copyspec:adaptive"])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    rows = workload_rows(args.workload, args.requests)[: args.requests]
    items = []
    for row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        items.append(BatchItem(row["id"], engine.prompt_ids(messages=messages),
                               DecodeParams(max_new_tokens=args.max_new_tokens)))
    print(f"# {args.workload}: {len(items)} requests, {args.max_new_tokens} new tokens, model {args.model}, dtype "
          f"{engine.target.dtype_name}, CPU flags: {cpu_flags()}, threads {torch.get_num_threads()}")
    results = []
    hf_outputs: dict[int, dict] = {}
    for size in args.batch_sizes:
        ordered = sorted(items, key=lambda i: len(i.prompt_ids))  # less padding, as a careful HF user does
        started, outputs = time.perf_counter(), {}
        for start in range(0, len(ordered), size):
            chunk = ordered[start : start + size]
            got = generate_batch(engine.target, [i.prompt_ids for i in chunk], [args.max_new_tokens] * len(chunk))
            outputs.update({i.key: ids for i, ids in zip(chunk, got)})
        wall = time.perf_counter() - started
        tokens = sum(len(v) for v in outputs.values())
        hf_outputs[size] = outputs
        results.append({"system": "hf_generate", "batch_size": size, "new_tokens": tokens, "wall_s": wall})
        print(json.dumps(results[-1]), flush=True)
    for method_text in args.methods:
        method, options = parse_method(method_text)
        for size in args.batch_sizes:
            started = time.perf_counter()
            got = dict(engine.decode_batch(items, method, options, batch_size=size))
            wall = time.perf_counter() - started
            ok = [r for r in got.values() if not r.get("error")]
            same = sum(got[i.key].get("output_token_ids") == hf_outputs[size][i.key] for i in items)
            results.append({"system": method_text, "batch_size": size, "new_tokens": sum(r["new_tokens"] for r in ok),
                            "wall_s": wall, "same_as_hf": same, "errors": len(got) - len(ok)})
            print(json.dumps(results[-1]), flush=True)
    hf = {r["batch_size"]: r["new_tokens"] / r["wall_s"] for r in results if r["system"] == "hf_generate"}
    best_hf = max(hf.values())
    print("\n| system | batch | tok/s | x HF same batch | x best HF |\n|---|---|---|---|---|")
    for r in results:
        tps = r["new_tokens"] / r["wall_s"]
        r["tokens_per_s"] = tps
        print(f"| {r['system']} | {r['batch_size']} | {tps:.1f} | {tps / hf[r['batch_size']]:.2f} | "
              f"{tps / best_hf:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"flags": cpu_flags(), "dtype": engine.target.dtype_name,
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
