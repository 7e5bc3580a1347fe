"""Host overhead of the decode loop: a tiny random 2-layer Llama, whose forward costs almost nothing, so a step's
time is the loop's own Python and host work. Our batched `ar` against HF `generate` (greedy, one padded batch), per
decode step, side by side in one run, alternating, best of the rounds.

  python benchmarks/host_overhead_bench.py                     # batch 64, 128 new tokens, 3 rounds
  python benchmarks/host_overhead_bench.py --batch-size 16 --profile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.batch_bench import hardware  # noqa: E402
from specdec_core.batch_decode import BatchDecoder, DecodeRequest  # noqa: E402
from specdec_core.decode import DecodeParams  # noqa: E402
from specdec_core.drafters.base import NoDrafter  # noqa: E402
from specdec_core.speculation_budget import SpeculationBudget  # noqa: E402
from tests.tiny_models import hf_greedy, repetitive_prompt, tiny_llama  # noqa: E402


def ours(runner, prompts: list[list[int]], new_tokens: int, batch_size: int) -> tuple[float, list[list[int]]]:
    """-> (seconds per decode step after the prefill, each row's tokens)."""
    decoder = BatchDecoder(runner, max_batch=batch_size, budget=SpeculationBudget(enabled=False))
    for key, prompt in enumerate(prompts):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=new_tokens), NoDrafter()))
    decoder.admit()
    started, steps = time.perf_counter(), 0
    while decoder.rows:
        decoder.step()
        steps += 1
    seconds = (time.perf_counter() - started) / steps
    got = {request.key: result.token_ids for request, result in decoder.finished}
    return seconds, [got[key] for key in range(len(prompts))]


def hf(runner, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds per decode step of HF `generate` over the left-padded batch (its prefill included, as it is one of
    new_tokens forwards)."""
    from pipelines.hf_batch_peer import left_padded

    ids, mask = left_padded(prompts)  # [n, longest], padding id 0
    started = time.perf_counter()
    with torch.inference_mode():
        runner.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0)
    return (time.perf_counter() - started) / new_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's table of our steps")
    args = parser.parse_args(argv)
    runner = tiny_llama()
    prompts = [repetitive_prompt(seed, 16 + seed % 32) for seed in range(args.batch_size)]
    _, tokens = ours(runner, prompts[:4], 8, 4)
    assert tokens == [hf_greedy(runner, prompt, 8) for prompt in prompts[:4]], "ar must equal HF greedy"
    hf(runner, prompts, 4)  # warm-up
    ours_s, hf_s = [], []
    for _ in range(args.rounds):
        ours_s.append(ours(runner, prompts, args.new_tokens, args.batch_size)[0])
        hf_s.append(hf(runner, prompts, args.new_tokens))
    print(f"{hardware('cpu')}, dtype float32, tiny Llama (2 layers, hidden 64), batch {args.batch_size}, "
          f"{args.new_tokens} new tokens, best of {args.rounds}")
    print(f"ours ar:      {min(ours_s) * 1e3:.2f} ms/step  (rounds: {', '.join(f'{s * 1e3:.2f}' for s in ours_s)})")
    print(f"HF generate:  {min(hf_s) * 1e3:.2f} ms/step  (rounds: {', '.join(f'{s * 1e3:.2f}' for s in hf_s)})")
    print(f"ours / HF speed: {min(hf_s) / min(ours_s):.2f}x")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ours(runner, prompts, 16, args.batch_size)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
