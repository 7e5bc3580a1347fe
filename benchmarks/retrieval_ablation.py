"""SPECTRA's refinement ablation (Table 2, "w/o PPL refine"), measured exactly: the mean accepted length of `rest`
with a perplexity-refined corpus index against indexes of as many texts drawn at random, over many requests.

  python jobs/refine_corpus.py --input corpus:aclsum --output out/refined --keep-fraction 0.25
  python jobs/refine_corpus.py --input corpus:aclsum --output out/random0 --keep-fraction 0.25 --selection random
  python benchmarks/retrieval_ablation.py --workload summarization --requests 100 \
      --index refined=out/refined/index --index random0=out/random0/index

The target decodes each request once with batched `ar`; then every index replays the greedy output
(benchmarks/greedy_replay.py): a token-only drafter's steps are fixed by the output itself, so the replay gives
the very accepted lengths the decoder gets with every draft verified (budget=off), for the drafter's cost alone.
Ratios are to the first --index; per request, the replayed MAL is compared too (how many requests each index wins).
A 2 % effect (the paper's 1.18x vs 1.16x speed-up) needs hundreds of requests to tell from noise: that is what the
replay is for. It measures accepted length, not speed: speed needs benchmarks/batch_bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.batch_bench import WORKLOADS, hardware, workload_items  # noqa: E402
from benchmarks.greedy_replay import ReplayResult, replay_greedy
from specdec_core.drafters.retrieval_index import check_index_tokenizer
from specdec_core.engine import Engine, EngineConfig
from specdec_core.methods import MethodOptions, get_method

MANIFEST_FIELDS = ("source", "selection", "seed", "keep", "keep_fraction", "texts", "tokens", "max_kept_ppl")


def greedy_outputs(engine, items, batch_size: int) -> dict:
    """request key -> the target's greedy output ids (batched `ar`)."""
    outputs = {}
    for key, result in engine.decode_batch(items, "ar", batch_size=batch_size):
        if result.get("error"):
            raise SystemExit(f"ar failed on {key}: {result['error']}")
        outputs[key] = result["output_token_ids"]
    return outputs


def replay_index(items, outputs: dict, directory: str, max_new_tokens: int, tree_nodes: int) -> dict:

    build = get_method("rest").build_drafter
    options = MethodOptions(retrieval_index=directory, tree_nodes=tree_nodes)
    total, per_request = ReplayResult(), {}
    started = time.perf_counter()
    for item in items:
        replayed = replay_greedy(build(options, None), item.prompt_ids, outputs[item.key], max_new_tokens)
        per_request[item.key] = replayed.mean_accepted_length
        total.add(replayed)
    manifest = json.loads((Path(directory) / "manifest.json").read_text())
    return {"mal": total.mean_accepted_length, "accepted": total.accepted, "drafted": total.drafted,
            "forwards": total.target_forwards, "new_tokens": total.new_tokens,
            "steps_with_draft": total.steps_with_draft, "replay_s": time.perf_counter() - started,
            "per_request": per_request, "manifest": {k: manifest.get(k) for k in MANIFEST_FIELDS}}


def table(results: dict) -> str:
    names = list(results)
    base = results[names[0]]
    lines = ["| index | selection | texts | tokens | MAL | x first | accepted/drafted | steps drafting | "
             "requests: wins / ties / losses vs first |", "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        r, m = results[name], results[name]["manifest"]
        pairs = [(r["per_request"][k], base["per_request"][k]) for k in base["per_request"]]
        wins = sum(a > b for a, b in pairs)
        ties = sum(a == b for a, b in pairs)
        selection = m["selection"] + (f" (seed {m['seed']})" if m.get("seed") is not None else "")
        steps = r["forwards"] - len(r["per_request"])
        lines.append(f"| {name} | {selection} | {m['texts']} | {m['tokens']} | {r['mal']:.4f} | "
                     f"{r['mal'] / base['mal']:.4f} | {r['accepted']}/{r['drafted']} | "
                     f"{r['steps_with_draft'] / max(1, steps):.2f} | "
                     + ("" if name == names[0] else f"{wins} / {ties} / {len(pairs) - wins - ties}") + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=["summarization"], choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=100, help="requests per workload")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="the batched ar pass that makes the outputs")
    parser.add_argument("--index", action="append", required=True, metavar="NAME=DIR",
                        help="a retrieval index; the first is the one the others are compared with")
    parser.add_argument("--tree-nodes", type=int, default=32, help="rest's draft tree size (its default: 32)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None, help="also write every result here")
    parser.add_argument("--outputs", default=None, metavar="FILE",
                        help="keep the greedy outputs in this JSON file: a later run with the same workloads, model "
                             "and dtype reads them instead of decoding again")
    return parser


def main() -> int:
    import torch


    parser = _parser()
    args = parser.parse_args()
    indexes = {}
    for spec in args.index:
        name, _, directory = spec.partition("=")
        if not name or not directory or not (Path(directory) / "manifest.json").is_file():
            parser.error(f"--index {spec!r}: expected NAME=DIR, DIR an index with a manifest.json")
        indexes[name] = os.path.abspath(directory)
    if args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")

    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    for directory in indexes.values():
        check_index_tokenizer(directory, engine.tokenizer, args.model)
    header = (f"{args.model}, dtype {engine.target.dtype_name}, device {engine.target.device}, "
              f"{hardware(engine.target.device)}, {args.requests} requests per workload, {args.max_new_tokens} new "
              f"tokens, rest with {args.tree_nodes} tree nodes, every draft verified (greedy replay)")
    print(f"# {header}", flush=True)
    report = {"header": header, "workloads": {}}
    saved = json.loads(Path(args.outputs).read_text()) if args.outputs and Path(args.outputs).is_file() else {}
    for workload in args.workload:
        items = workload_items(engine, workload, args.requests, args.max_new_tokens, args.batch_size)
        outputs, how = _greedy_outputs(engine, workload, items, saved, args)
        print(f"\n## {workload}: {len(items)} requests, {sum(map(len, outputs.values()))} greedy tokens "
              f"({how})\n", flush=True)
        results = {name: replay_index(items, outputs, directory, args.max_new_tokens, args.tree_nodes)
                   for name, directory in indexes.items()}
        print(table(results) + "\n", flush=True)
        report["workloads"][workload] = results
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _greedy_outputs(engine, workload: str, items: list, saved: dict, args) -> tuple[dict, str]:
    """Every item's greedy output, read from --outputs' file when it holds them all, else decoded by batched ar (and
    saved there) -> ({item key: ids}, where they came from)."""
    started = time.perf_counter()
    tag = f"{workload}/{args.model}/{engine.target.dtype_name}/{args.max_new_tokens}"
    outputs = saved.get(tag, {})
    if any(str(item.key) not in outputs for item in items):
        outputs = {str(key): ids for key, ids in greedy_outputs(engine, items, args.batch_size).items()}
        saved[tag] = outputs
        if args.outputs:
            Path(args.outputs).write_text(json.dumps(saved))
        how = f"{time.perf_counter() - started:.0f} s of batched ar"
    else:
        how = f"read from {args.outputs}"
    return {item.key: outputs[str(item.key)] for item in items}, how


if __name__ == "__main__":
    sys.exit(main())
