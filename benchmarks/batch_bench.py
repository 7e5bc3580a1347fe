"""Batched decoding vs HF `generate` greedy, side by side in one run (no Ray): job throughput per batch size.

  python benchmarks/batch_bench.py --workload code_edit summarization --requests 32 --batch-sizes 1 4 8 16 32 \
      --methods ar copyspec@1,16 pld@16 copyspec:candidates=3 copyspec:adaptive@16

Per workload, one line per (system, batch size): new tokens, wall s, tok/s, the ratio to HF at the same batch size,
to the best HF batch size and to our `ar` at the same batch size, and how many outputs equal HF's (exact in fp32;
bf16 near-ties may flip). HF runs at every --batch-sizes, and so does each method unless it names its own
(`pld@16,32`). Records the CPU flags (or GPU name), the dtype and the process's peak memory.

Workloads: summarization, code_edit, humaneval, open_questions (MT-Bench first turns: little to copy), rag (ACLSum questions:
the prompt holds the first 6,000 characters of the paper, copy drafters also see the whole paper as `context`) and
multi_turn, which times the second turn only (MT-Redundant: revise your first answer), its history holding one
shared first answer decoded beforehand with batched `ar` (untimed), so every system gets identical prompts.
MAL = mean accepted length (new tokens / target forwards, prefill included); decode x ar = tokens per second of the
pass less its prefill against `ar`'s (what speculation changes, without the prefill's noise); prefill share = the pass's seconds spent
prefilling prompts (what no speculation can shorten: on a CPU, prefill is compute-bound); quality = the mean of the task's metric
against the references (ROUGE-L for summaries, exact match for code edits, token F1 for RAG; analysis/quality.py);
host share = of the decode time (less prefill and captures), the share outside graph-ready steps (a GPU's): the loop's
own host work, which adds to every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from analysis.quality import score
from operators.context_compressor import SelfInformationCompressor
from operators.read_requests import workload_rows
from operators.task_prompts import DEFAULT_MAX_CONTEXT_CHARS, compose_prompt
from pipelines.hf_batch_peer import generate_batch
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402
from specdec_core.engine import BatchItem, Engine, EngineConfig
from specdec_core.kernels.linear_plan import cpu_description
from specdec_core.loop.requests import DecodeParams
from specdec_core.methods import MethodOptions
from specdec_core.warm_up import freeze_heap

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

WORKLOADS = ("summarization", "code_edit", "open_questions", "multi_turn", "rag", "humaneval")


def hardware(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"GPU {torch.cuda.get_device_name()}"
    return cpu_description()


INDEXES: dict[str, str] = {}  # --index NAME=DIR: the retrieval indexes methods name with index=NAME


def parse_method(text: str):
    """'copyspec:candidates=3,adaptive@16,32' -> ('copyspec', MethodOptions(candidates=3, adaptive=True)); the
    batch sizes after '@' are read by `method_sizes`."""
    name, _, extra = text.split("@")[0].partition(":")
    options = {}
    for part in filter(None, extra.split(",")):
        key, _, value = part.partition("=")
        if key in ("budget", "tail"):  # read by `run_ours`, not method options
            if value not in ("on", "off"):
                raise ValueError(f"{key}={value!r}: use {key}=on or {key}=off")
            continue
        if key == "memory":  # read by `run_ours`: the job memory starts with --memory-seed's outputs
            if value != "seed":
                raise ValueError(f"memory={value!r}: use memory=seed (with --memory-seed N)")
            continue
        if key == "index":  # a retrieval index named by --index NAME=DIR
            if value not in INDEXES:
                raise ValueError(f"index={value!r}: name it with --index {value}=DIR")
            options["retrieval_index"] = INDEXES[value]
            continue
        options[key] = True if value == "" else None if value == "none" else float(value) if "." in value \
            else int(value)
    return name, MethodOptions(**options)


def speculation_budget_on(text: str) -> bool:
    """'pld:budget=off' verifies every draft as proposed (the papers' setting, for mean accepted length)."""
    return "budget=off" not in text.split("@")[0]


def method_sizes(text: str, default: list[int]) -> list[int]:
    _, at, sizes = text.partition("@")
    return [int(size) for size in sizes.split(",")] if at else default


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def workload_items(engine, workload: str, requests: int, max_new_tokens: int, batch_size: int,
                   compress_context: float | None = None, skip: int = 0) -> list:
    """BatchItems for a workload; multi_turn: turn-2 prompts whose history holds a batched-ar first answer.
    Question rows (rag) are composed as the prompt stage does, their context compressed `compress_context` times
    by the target model when asked (operators/compress_context.py; untimed, like the prompt stage)."""

    rows = workload_rows(workload, skip + requests)[skip: skip + requests]
    compressor = SelfInformationCompressor(engine.target.model, engine.tokenizer) if compress_context else None
    for row in rows:
        if compressor is not None and row.get("question") is not None:
            row["prompt_context"] = compressor.compress(row["context"][:DEFAULT_MAX_CONTEXT_CHARS], compress_context)
        if row.get("prompt") is None and not row.get("messages"):
            row["prompt"] = compose_prompt(row)
    params = DecodeParams(max_new_tokens=max_new_tokens)
    items = [BatchItem(row["id"], engine.prompt_ids(messages=row.get("messages")
                                                    or [{"role": "user", "content": row["prompt"]}]), params,
                       engine.context_ids(row["context"]) if row.get("context") else None)
             for row in rows]
    if workload != "multi_turn":
        return items
    first = dict(engine.decode_batch(items, "ar", batch_size=batch_size))
    second = []
    for row in rows:
        messages = row["messages"] + [{"role": "assistant", "content": first[row["id"]]["output_text"]},
                                      {"role": "user", "content": row["next_turns"][0]}]
        second.append(BatchItem(row["id"], engine.prompt_ids(messages=messages), params))
    return second


def workload_references(workload: str, requests: int) -> dict:
    """request id -> (task, reference) for the rows that have one (quality: analysis.quality.score)."""

    return {row["id"]: (row.get("task"), row["reference"]) for row in workload_rows(workload, requests)[:requests]
            if row.get("reference") and workload != "multi_turn"}


def mean_quality(got: dict, references: dict) -> float | None:
    values = [score(references[key][0], r["output_text"], references[key][1])[1] for key, r in got.items()
              if key in references and not r.get("error")]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def run_hf(engine, items, size: int, max_new_tokens: int) -> tuple[dict, dict]:

    ordered = sorted(items, key=lambda i: len(i.prompt_ids))  # less padding, as a careful HF user does
    synchronize(engine.target.device)
    started, outputs = time.perf_counter(), {}
    for start in range(0, len(ordered), size):
        chunk = ordered[start: start + size]
        got = generate_batch(engine.target, [i.prompt_ids for i in chunk], [max_new_tokens] * len(chunk))
        outputs.update({i.key: ids for i, ids in zip(chunk, got)})
    synchronize(engine.target.device)
    wall = time.perf_counter() - started
    return {"system": "hf_generate", "batch_size": size, "new_tokens": sum(len(v) for v in outputs.values()),
            "wall_s": wall}, outputs


def warm_up(engine, items, methods: list[str], memory_seed: list | None = None, batch_size: int = 1) -> None:
    """Untimed: a process's first forwards are slow, and HF, timed first, would pay for it; and the first use of a
    drafter's numba kernels on a machine compiles them (cached on disk after), which would land in that method's
    first timed pass. The first prefill of a whole batch is slow too, so `ar` also prefills `batch_size` of the
    prompts once (decisions.md: benchmarks/batch_bench.py). Then the heap is frozen, as a decode actor's is after its
    warm-up (warm_up.freeze_heap)."""

    generate_batch(engine.target, [items[0].prompt_ids], [4])
    short = [dataclasses.replace(items[0], params=dataclasses.replace(items[0].params, max_new_tokens=8))]
    for method_text in dict.fromkeys(["ar"] + [text.split("@")[0] for text in methods]):
        run_ours(engine, short, method_text, 1, None, None, memory_seed)
    if batch_size > 1:
        batch = [dataclasses.replace(i, params=dataclasses.replace(i.params, max_new_tokens=2))
                 for i in items[:batch_size]]
        run_ours(engine, batch, "ar", batch_size, None)
    freeze_heap()


def run_ours(engine, items, method_text: str, size: int, hf_outputs: dict | None,
             references: dict | None = None, memory_seed: list | None = None, outputs: dict | None = None) -> dict:
    """One timed pass of a method over `items` at batch `size` -> its result row; `outputs`, when given, gets each
    request's output token ids (None for a row that failed)."""
    method, options = parse_method(method_text)
    # Every run learns its own step costs and acceptance from its own steps, as a fresh actor would (a job's later
    # passes reuse them), prefills its own prompts, and starts with an empty job memory...
    engine.forget()
    if "memory=seed" in method_text:  # ... or holds earlier runs' outputs of other documents: seeded untimed)
        if not memory_seed:
            raise ValueError("memory=seed needs --memory-seed N")
        engine.memory_for(method).seed_sequences(memory_seed)
    decoder = engine.decoder(size, speculation_budget=speculation_budget_on(method_text), method=method)
    decoder.budget.tail_rule = "tail=off" not in method_text.split("@")[0]  # SpeculationBudget.tail_rule
    for item in items:
        decoder.submit(engine.request(item, method, options, decoder))
    synchronize(engine.target.device)
    started = time.perf_counter()
    got = dict(engine.results(decoder, method))
    synchronize(engine.target.device)
    wall = time.perf_counter() - started
    ok = [r for r in got.values() if not r.get("error")]
    stats = decoder.stats
    result = {"system": method_text.split("@")[0], "batch_size": size, "new_tokens": sum(r["new_tokens"] for r in ok),
              "wall_s": wall, "errors": len(got) - len(ok), "mean_occupancy": stats.mean_occupancy,
              "drafted": stats.drafted_tokens, "verified": stats.verified_tokens, "accepted": stats.accepted_tokens,
              "steps": stats.steps, "peak_kv_mib": stats.peak_cache_bytes / 2**20, "prefill_s": stats.prefill_s,
              "capture_s": stats.capture_s, "graph_s": stats.graph_s,
              "mean_accepted_length": sum(r["new_tokens"] for r in ok) / max(1, sum(r["target_forwards"] for r in ok)),
              "from_context": sum(r["accepted_by_source"].get("context", 0) for r in ok),
              "from_memory": sum(r["accepted_by_source"].get("memory", 0) for r in ok),
              "quality": mean_quality(got, references or {})}
    if outputs is not None:
        outputs.update({key: None if r.get("error") else r.get("output_token_ids") for key, r in got.items()})
    if hf_outputs is not None:
        result["same_as_hf"] = sum(got[i.key].get("output_token_ids") == hf_outputs[i.key] for i in items)
    return result


def table(results: list[dict]) -> str:
    hf = {r["batch_size"]: r["tokens_per_s"] for r in results if r["system"] == "hf_generate"}
    ar = {r["batch_size"]: r["tokens_per_s"] for r in results if r["system"] == "ar"}  # plain "ar" only
    ar_decode = {r["batch_size"]: _decode_speed(r) for r in results if r["system"] == "ar"}
    best_hf = max(hf.values(), default=None)
    lines = ["| system | batch | new tokens | tok/s | x HF same batch | x best HF | x ar same batch | decode x ar | "
             "accepted/verified | from memory | MAL | occupancy | prefill share | = HF | quality | host share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda value, base: f"{value / base:.2f}" if base else ""  # noqa: E731
    for r in results:
        tps = r["tokens_per_s"]
        acc = f"{r['accepted']}/{r['verified']}" if r.get("verified") else ""
        occ = f"{r['mean_occupancy']:.1f}" if r.get("mean_occupancy") else ""
        mal = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else ""
        quality = f"{r['quality']:.3f}" if r.get("quality") is not None else ""
        prefill = f"{r['prefill_s'] / r['wall_s']:.2f}" if r.get("prefill_s") else ""
        decode = _decode_speed(r)
        lines.append(f"| {r['system']} | {r['batch_size']} | {r['new_tokens']} | {tps:.1f} | "
                     f"{ratio(tps, hf.get(r['batch_size']))} | {ratio(tps, best_hf)} | "
                     f"{ratio(tps, ar.get(r['batch_size']))} | "
                     f"{ratio(decode, ar_decode.get(r['batch_size'])) if decode else ''} | {acc} | {r.get('from_memory') or ''} | {mal} | "
                     f"{occ} | {prefill} | "
                     f"{r.get('same_as_hf', '')} | "
                     f"{quality} | {_host_share(r)} |")
    return "\n".join(lines)


def _host_share(result: dict) -> str:
    """Of the pass's decode time (less prefill and captures), the share outside graph-ready steps: the loop's host
    work, which on a GPU adds to every step (empty where no step was graph-ready)."""
    decode = result["wall_s"] - (result.get("prefill_s") or 0.0) - (result.get("capture_s") or 0.0)
    if not result.get("graph_s") or decode <= 0:
        return ""
    return f"{1 - result['graph_s'] / decode:.2f}"


def _decode_speed(result: dict) -> float | None:
    """New tokens per second of the pass less its prefill: what speculation can change."""
    if not result.get("prefill_s") or result["wall_s"] <= result["prefill_s"]:
        return None
    return result["new_tokens"] / (result["wall_s"] - result["prefill_s"])


def rounds_table(results: list[dict]) -> str:
    """Each method's tok/s per round and its ratio to the `ar` pass of the same round and batch size (interleaved
    passes share the machine's slow and fast spells, so their ratio is steadier than either speed)."""
    ours = [r for r in results if "round" in r]
    ar = {(r["round"], r["batch_size"]): r["tokens_per_s"] for r in ours if r["system"] == "ar"}
    lines = ["| system | batch | tok/s per round | x ar per round | median x ar | min x ar |",
             "|---|---|---|---|---|---|"]
    for system, size in dict.fromkeys((r["system"], r["batch_size"]) for r in ours):
        runs = [r for r in ours if (r["system"], r["batch_size"]) == (system, size)]
        ratios = [r["tokens_per_s"] / ar[(r["round"], size)] for r in runs if (r["round"], size) in ar]
        speeds = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs)
        lines.append(f"| {system} | {size} | {speeds} | {', '.join(f'{x:.2f}' for x in ratios)} | "
                     f"{statistics.median(ratios):.2f} | {min(ratios):.2f} |" if ratios else
                     f"| {system} | {size} | {speeds} | | | |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=32, help="requests per workload")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16, 32],
                        help="HF, and methods without @SIZES")
    parser.add_argument("--methods", nargs="+", default=["ar", "copyspec", "pld", "copyspec:candidates=3",
                                                         "copyspec:adaptive"],
                        help="NAME[:option=value,...][@SIZES], e.g. copyspec:candidates=3 or pld@16,32 (own batch "
                             "sizes); the option budget=off verifies every draft as proposed (no speculation budget), "
                             "tail=off lets every row draft when nothing waits for a slot (SpeculationBudget.tail_rule)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method this many times, interleaved (round 1: each method once, then round "
                             "2, ...), and print each method's per-round ratio to the same round's ar: on a noisy "
                             "machine one run cannot settle a 5 %% difference")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate")
    parser.add_argument("--memory-seed", type=int, default=0, metavar="N",
                        help="decode N other requests of each workload with ar (untimed): their outputs seed the job "
                             "memory of the methods given the option memory=seed (e.g. suffix:memory=seed), as "
                             "--memory-from seeds a nightly job with last night's outputs")
    parser.add_argument("--compress-context", type=float, default=None, metavar="R",
                        help="rag: the prompt carries its 6,000 context characters compressed R times (tokens)")
    parser.add_argument("--index", action="append", default=[], metavar="NAME=DIR",
                        help="a retrieval index (jobs/refine_corpus.py, specbatch build-index) that methods name "
                             "with the option index=NAME, e.g. --index refined=out/index --methods rest:index=refined")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafter-dtype", default=None,
                        help="the draft model's dtype (default: int8 for a bf16 target on a CPU, else the "
                             "target's); int8 = int8 linear layers (CPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name or a model directory")
    parser.add_argument("--drafter", default=None,
                        help="a draft model for draft / slem / tli / union (any tokenizer for the last three)")
    parser.add_argument("--json", default=None, help="also write every result here")
    return parser


def main() -> int:
    import torch


    parser = build_parser()
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    for spec in args.index:
        name, _, directory = spec.partition("=")
        INDEXES[name] = os.path.abspath(directory)
    for text in args.methods:
        parse_method(text)  # a bad method option fails before the model loads
    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, drafter=args.drafter,
                                 drafter_dtype=args.drafter_dtype))
    header = _header(engine, args)
    print(f"# {header}", flush=True)
    report = {"header": header, "workloads": {}}
    for workload in args.workload:
        report["workloads"][workload] = run_workload(engine, workload, args, warm=workload == args.workload[0])
    if engine.target.device.startswith("cuda"):
        report["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    report["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak process memory {report['peak_rss_mib']:.0f} MiB"
          + (f", peak GPU memory {report['peak_gpu_mib']:.0f} MiB" if "peak_gpu_mib" in report else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def _header(engine, args) -> str:
    """The run's first line: models, dtype, device, CPU flags, sizes."""
    device = engine.target.device
    drafter = ""
    if args.drafter:
        overlap = None if engine.same_vocabulary else engine.vocab_mapping().overlap()
        shares = (f" (shares {overlap['shared']:,} tokens: {overlap['shared_of_target']:.1%} of the target's "
                  "vocabulary)") if overlap else ""
        drafter = f", drafter {args.drafter} ({engine.draft_model.dtype_name}){shares}"
    return (f"{args.model}{drafter}, dtype {engine.target.dtype_name}, device {device}, {hardware(device)}, "
            f"{args.requests} requests per workload, {args.max_new_tokens} new tokens, one run"
            + (f", context compressed {args.compress_context:g}x" if args.compress_context else ""))


def run_workload(engine, workload: str, args, warm: bool) -> list[dict]:
    """HF at each batch size, then every method at its sizes once per round (rounds interleaved); prints each result
    as a JSON line and the workload's tables -> the results."""
    biggest = max(args.batch_sizes)
    items = workload_items(engine, workload, args.requests, args.max_new_tokens, biggest, args.compress_context)
    references = workload_references(workload, args.requests)
    memory_seed = memory_seed_outputs(engine, workload, args.memory_seed, args.requests, args.max_new_tokens, biggest,
                                      args.compress_context) if args.memory_seed else None
    if warm:
        warm_up(engine, items, args.methods, memory_seed, biggest)
    results, hf_outputs = [], {}
    if not args.no_hf:
        for size in args.batch_sizes:
            result, hf_outputs[size] = run_hf(engine, items, size, args.max_new_tokens)
            results.append(result)
            print(json.dumps({"workload": workload, **result}), flush=True)
    for round_number in range(1, args.rounds + 1):
        for method_text in args.methods:
            for size in method_sizes(method_text, args.batch_sizes):
                results.append(run_ours(engine, items, method_text, size, hf_outputs.get(size), references,
                                        memory_seed))
                results[-1]["round"] = round_number
                print(json.dumps({"workload": workload, **results[-1]}), flush=True)
    for r in results:
        r["tokens_per_s"] = r["new_tokens"] / r["wall_s"]
    first_round = [r for r in results if r.get("round", 1) == 1]
    print(f"\n## {workload} ({len(items)} requests{', turn 2' if workload == 'multi_turn' else ''})\n\n"
          f"{table(first_round)}\n", flush=True)
    if args.rounds > 1:
        print(f"{rounds_table(results)}\n", flush=True)
    return results


def memory_seed_outputs(engine, workload: str, count: int, skip: int, max_new_tokens: int, batch_size: int,
                        compress_context: float | None = None) -> list[list[int]]:
    """`ar`'s outputs (untimed) for `count` other documents of the workload (the rows after the `skip` timed ones):
    what a method with the option memory=seed starts its job memory with, as --memory-from seeds a nightly job."""
    others = workload_items(engine, workload, count, max_new_tokens, batch_size, compress_context, skip=skip)
    return [r["output_token_ids"] for _, r in engine.decode_batch(others, "ar", batch_size=batch_size)
            if not r["error"]]


if __name__ == "__main__":
    sys.exit(main())
