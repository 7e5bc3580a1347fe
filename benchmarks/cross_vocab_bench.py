"""Drafters with another tokenizer: our `slem`, `tli` and `union` against Hugging Face's universal
assisted generation (`generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)`), all at batch 1, with
plain greedy `generate` and our `ar` as the baselines; one run, side by side. (Batched: benchmarks/batch_bench.py
--drafter D --methods slem@8 against HF batched greedy.)

    python benchmarks/cross_vocab_bench.py --model qwen2.5-coder-1.5b --drafter smollm2-135m --requests 4
    python benchmarks/cross_vocab_bench.py --workload summarization --temperature 1 --systems ar tli union

Prompts: HumanEval's first N (raw completion prompts) or the summarization workload's (chat template), the same ids
for every system. HF systems decode --max-new-tokens greedily; ours greedily too, or with --temperature T sampled
(seed = the request's index), where `= ar` is not defined. `= ar` counts greedy outputs identical to our ar.
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
from benchmarks.batch_bench import hardware, workload_items  # noqa: E402
from corpora.code_edit import humaneval_rows  # noqa: E402
from specdec_core.engine import BatchItem, Engine, EngineConfig  # noqa: E402
from specdec_core.loop.requests import DecodeParams  # noqa: E402
from specdec_core.loop.sampling import SamplingParams  # noqa: E402
from specdec_core.methods import MethodOptions  # noqa: E402
from specdec_core.model.model_runner import ModelRunner  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--drafter-dtype", default=None,
                        help="the draft model's dtype (default: int8 for a bf16 target on a CPU, else the "
                             "target's); int8 = int8 linear layers (CPU)")
    parser.add_argument("--peer-drafter-dtype", default=None,
                        help="the HF peer's assistant dtype (default: the same drafter as ours); e.g. bfloat16 to give "
                             "the peer the model as a user loads it while ours runs its default int8")
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="most drafter tokens per step (slem, tli, union; default: the method's)")
    parser.add_argument("--adaptive", action="store_true", help="adapt the draft length")
    parser.add_argument("--draft-confidence", type=_confidence, nargs="+", default=["priced"],
                        help="stop a draft once the drafter's probability of it falls below this ('priced': below "
                             "the measured price of a drafted token); several values run each of our drafting "
                             "systems once per value")
    parser.add_argument("--no-budget", action="store_true", help="verify every draft (no speculation budget)")
    parser.add_argument("--systems", nargs="+", default=["ar", "slem", "hf_greedy", "hf_universal_assisted"],
                        choices=["ar", "slem", "tli", "union", "slrs", "hf_greedy", "hf_universal_assisted"])
    parser.add_argument("--workload", default="humaneval", choices=["humaneval", "summarization"])
    parser.add_argument("--temperature", type=float, default=0.0, help="our systems sample at T (HF stays greedy)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system once per round, rounds interleaved; ratios are taken within a round "
                             "(single passes on these CPUs vary by 10 %%: interleaved ones share the slow spells)")
    return parser


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")

    import torch


    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", drafter=args.drafter,
                                 drafter_dtype=args.drafter_dtype))
    draft = engine.draft_model
    peer_draft = draft if args.peer_drafter_dtype in (None, draft.dtype_name) else \
        ModelRunner.load(args.drafter, args.peer_drafter_dtype, "cpu")
    prompts = _prompts(engine, args)
    systems = _systems(engine, peer_draft, prompts, args)
    _warm_up(engine, prompts[0])
    chosen = [key for name in args.systems for key in systems if key == name or key.startswith(name + "@")]
    rounds = _run_rounds(systems, chosen, args.rounds)
    _report(engine, peer_draft, prompts, chosen, rounds, args)
    return 0


def _prompts(engine, args) -> list[list[int]]:
    """HumanEval's raw completion prompts, or a batch_bench workload's chat-templated ones."""
    if args.workload == "humaneval":

        return [engine.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
                for row in humaneval_rows(args.requests)]

    return [item.prompt_ids for item in workload_items(engine, args.workload, args.requests, 1, 1)]


def _systems(engine, peer_draft, prompts: list[list[int]], args) -> dict:
    """{name: a callable that decodes every prompt at batch 1 -> (outputs, wall seconds, target forwards or None)}:
    ours per method (and per draft confidence when several are given), HF greedy and HF's universal assisted
    generation."""
    systems = {"ar": lambda: _ours(engine, prompts, args, "ar")}
    for name in ("slem", "tli", "union", "slrs"):
        for value in args.draft_confidence:
            systems[name if len(args.draft_confidence) == 1 else f"{name}@conf{value}"] = \
                (lambda name=name, value=value: _ours(engine, prompts, args, name, value))
    systems.update(hf_greedy=lambda: _hf(engine.target, None, prompts, args.max_new_tokens),
                   hf_universal_assisted=lambda: _hf(engine.target, peer_draft, prompts, args.max_new_tokens))
    return systems


def _ours(engine, prompts: list[list[int]], args, method: str, confidence=0.0):

    options = MethodOptions(draft_tokens=args.draft_tokens, adaptive=args.adaptive, draft_confidence=confidence)
    outputs, started, forwards = [], time.perf_counter(), 0
    for index, ids in enumerate(prompts):  # batch 1, one request after the other
        params = DecodeParams(max_new_tokens=args.max_new_tokens,
                              sampling=SamplingParams(temperature=args.temperature, seed=index))
        [(_, result)] = list(engine.decode_batch([BatchItem(0, ids, params)], method, options, batch_size=1,
                                                 speculation_budget=not args.no_budget))
        outputs.append(result["output_token_ids"])
        forwards += result["target_forwards"]
    return outputs, time.perf_counter() - started, forwards


def _hf(target, assistant, prompts: list[list[int]], max_new_tokens: int):
    """HF greedy `generate` at batch 1, with `assistant` (a ModelRunner) as its universal assisted drafter if given."""
    import torch

    outputs, started = [], time.perf_counter()
    extra = {"assistant_model": assistant.model, "tokenizer": target.tokenizer,
             "assistant_tokenizer": assistant.tokenizer} if assistant is not None else {}
    with torch.inference_mode():
        for ids in prompts:
            out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                        pad_token_id=target.tokenizer.pad_token_id or 0, **extra)
            outputs.append(out[0, len(ids):].tolist())
    return outputs, time.perf_counter() - started, None


def _warm_up(engine, prompt: list[int]) -> None:
    """Untimed: the first forwards of a process are slow, and the first system timed would pay for it."""

    warm = DecodeParams(max_new_tokens=4)
    engine.generate_ids(prompt, "ar", warm)
    engine.generate_ids(prompt, "slem", warm)
    _hf(engine.target, None, [prompt], 4)


def _run_rounds(systems: dict, chosen: list[str], rounds: int) -> list[dict]:
    """Every chosen system once per round, rounds interleaved -> [{system: its results}] per round."""
    results_by_round: list[dict] = []
    for round_index in range(rounds):
        results = {}
        for name in chosen:
            outputs, wall, forwards = systems[name]()
            tokens = sum(len(o) for o in outputs)
            results[name] = {"tokens": tokens, "wall_s": round(wall, 1), "tok_s": round(tokens / wall, 2),
                             "mean_accepted_length": round(tokens / forwards, 2) if forwards else None,
                             "outputs": outputs}
            print(json.dumps({"round": round_index, "system": name,
                              **{k: v for k, v in results[name].items() if k != "outputs"}}), flush=True)
        results_by_round.append(results)
    return results_by_round


def _report(engine, peer_draft, prompts, chosen: list[str], rounds: list[dict], args) -> None:
    overlap = engine.vocab_mapping().overlap() if not engine.same_vocabulary else None
    print(f"\n# {args.model} <- {args.drafter} ({engine.draft_model.dtype_name}; the HF peer's "
          f"{peer_draft.dtype_name}), dtype {engine.target.dtype_name}, {hardware('cpu')}, {len(prompts)} "
          f"{args.workload} prompts x {args.max_new_tokens} new tokens, batch 1, {args.rounds} round(s) interleaved, "
          f"ours at T={args.temperature:g}; {args.draft_tokens or 'the method default of'} drafter tokens per step"
          f"{', adaptive' if args.adaptive else ''}"
          f"{', draft confidence ' + str(args.draft_confidence[0]) if len(args.draft_confidence) == 1 else ''}"
          f"{', no budget' if args.no_budget else ''}; vocabulary overlap "
          f"{overlap}\n")
    print("| system | tok/s (mean) | x ar per round | x HF assisted per round | x HF assisted, median | MAL | = ar |\n"
          "|---|---|---|---|---|---|---|")
    reference = rounds[0]["ar"]["outputs"] if "ar" in chosen and not args.temperature else None
    for name in chosen:
        runs = [r[name] for r in rounds]
        over_ar = [r[name]["tok_s"] / r["ar"]["tok_s"] for r in rounds] if "ar" in chosen else []
        over_peer = [r[name]["tok_s"] / r["hf_universal_assisted"]["tok_s"] for r in rounds] \
            if "hf_universal_assisted" in chosen else []
        same = (f"{sum(a[: len(b)] == b[: len(a)] for run in runs for a, b in zip(run['outputs'], reference))}/"
                f"{len(prompts) * len(runs)}" if reference is not None else "n/a")
        mal = sorted(run["mean_accepted_length"] for run in runs if run["mean_accepted_length"])
        print(f"| {name} | {sum(run['tok_s'] for run in runs) / len(runs):.2f} | {_listed(over_ar)} | "
              f"{_listed(over_peer)} | {f'{statistics.median(over_peer):.2f}' if over_peer else ''} | "
              f"{', '.join(f'{m:g}' for m in mal)} | {same} |")


def _confidence(text: str) -> float | str:
    if text == "priced":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'priced' or a probability") from None


def _listed(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    sys.exit(main())
