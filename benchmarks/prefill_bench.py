"""Prefill throughput: the batched loop's admission (prompts fed together in chunked forwards under a token budget,
prefill_plan.py) against one large batched forward over the same prompts, side by side in one process, alternating,
median of the rounds. Prompt tokens per second; the target is ours >= 0.9x the one large forward.

- ours: BatchDecoder.admit() of every prompt at once (budget PREFILL_TOKENS, or each of --budgets), the prefix cache
  off and, for the first budget, on (a fresh decoder each round, so only prompts of one admission share prefixes);
- one forward, ours: the same admission with a budget above the prompts' total: every prompt in one ragged forward;
- one forward, HF: the model's own forward over the left-padded [n, longest] batch, logits of the last position only.

  python benchmarks/prefill_bench.py                                   # open questions 16, summaries 8, code edits 8
  python benchmarks/prefill_bench.py --workload summarization:16 --rounds 5
  python benchmarks/prefill_bench.py --workload code_edit:16 --budgets 1024 2048 4096   # which budget here
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.batch_bench import hardware, workload_items  # noqa: E402
from pipelines.hf_batch_peer import left_padded
from specdec_core.drafters.base import NoDrafter
from specdec_core.engine import Engine, EngineConfig
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.prefill_plan import PREFILL_TOKENS
from specdec_core.loop.prefix_cache import PrefixCache
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.speculation_budget import SpeculationBudget
from specdec_core.model.model_registry import DEFAULT_MODEL

DEFAULT_WORKLOADS = ("open_questions:16", "summarization:8", "code_edit:8")


def ours(engine, prompts: list[list[int]], budget: int | None, prefix_cache: bool) -> float:
    """Seconds to admit (prefill) every prompt in one decoder."""

    options = {} if budget is None else {"prefill_tokens": budget}
    decoder = BatchDecoder(engine.target, max_batch=len(prompts), budget=SpeculationBudget(enabled=False),
                           prefix_cache=None if prefix_cache else PrefixCache(budget_bytes=0), **options)
    for key, prompt in enumerate(prompts):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=2), NoDrafter()))
    started = time.perf_counter()
    decoder.admit()
    seconds = time.perf_counter() - started
    assert len(decoder.rows) == len(prompts), "every prompt must be admitted at once"
    return seconds


def hf_one_forward(engine, prompts: list[list[int]]) -> float:
    """Seconds of the model's own forward over the left-padded batch (last position's logits only)."""
    ids, mask = left_padded(prompts)  # [n, longest], padding id 0
    model = engine.target.model
    started = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids.to(engine.target.device), attention_mask=mask.to(engine.target.device),
              logits_to_keep=1, use_cache=False)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", action="append", help="NAME:REQUESTS (repeatable; default: "
                                                            f"{', '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budgets", type=int, nargs="+", default=[PREFILL_TOKENS], metavar="TOKENS",
                        help="prefill token budgets to time side by side (prefix cache off beyond the first)")
    args = parser.parse_args(argv)
    if min(args.budgets) < 1:
        parser.error("--budgets: each budget must be >= 1")
    engine = Engine(EngineConfig(args.model, args.dtype, "cpu"))
    print(f"{hardware('cpu')}, dtype {engine.target.dtype}, {args.model}, median of {args.rounds} rounds")
    for spec in args.workload or DEFAULT_WORKLOADS:
        name, _, count = spec.partition(":")
        prompts = [item.prompt_ids for item in workload_items(engine, name, int(count or 16), 1, int(count or 16))]
        tokens = sum(map(len, prompts))
        first = args.budgets[0]
        ways = {
            f"ours (budget {first}), prefix cache off": lambda: ours(engine, prompts, first, False),
            f"ours (budget {first}), prefix cache on": lambda: ours(engine, prompts, first, True),
            **{f"ours (budget {budget}), prefix cache off": (lambda budget=budget: ours(engine, prompts, budget, False))
               for budget in args.budgets[1:]},
            "one forward, ours": lambda: ours(engine, prompts, tokens + 1, False),
            "one forward, HF (left-padded)": lambda: hf_one_forward(engine, prompts),
        }
        for way in ways.values():  # warm-up
            way()
        seconds = {label: [] for label in ways}
        for _ in range(args.rounds):
            for label, way in ways.items():
                seconds[label].append(way())
        rate = {label: tokens / statistics.median(values) for label, values in seconds.items()}
        print(f"\n{name}: {len(prompts)} prompts, {tokens} tokens ({min(map(len, prompts))}-"
              f"{max(map(len, prompts))} a prompt)")
        for label, value in rate.items():
            print(f"  {label:40s} {value:8.1f} tok/s   x one forward, ours {value / rate['one forward, ours']:.2f}"
                  f"   x one forward, HF {value / rate['one forward, HF (left-padded)']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
