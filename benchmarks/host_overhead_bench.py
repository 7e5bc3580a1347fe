"""Host overhead of the decode loop: a tiny random 2-layer Llama, whose forward costs almost nothing, so a step's
time is the loop's own Python and host work. Our batched `ar` against HF `generate` (greedy, one padded batch), per
decode step, side by side in one run, alternating, best of the rounds.

--shape gives the random model a real model's architecture instead (no weights to fetch): the step then costs what
that model's forward costs, e.g. Qwen2.5-Coder-1.5B on a lent GPU. Random weights decide the tokens, so this times
`ar` only (speculation's acceptance needs the real weights).

  python benchmarks/host_overhead_bench.py                     # batch 64, 128 new tokens, 3 rounds
  python benchmarks/host_overhead_bench.py --batch-size 16 --profile
  python benchmarks/host_overhead_bench.py --device cuda --dtype bfloat16 --shape qwen2.5-1.5b --prompt-tokens 400
  python benchmarks/host_overhead_bench.py --device cuda --fast-forward both   # HF's modules vs fast_forward.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.batch_bench import hardware  # noqa: E402
from pipelines.hf_batch_peer import left_padded
from specdec_core.drafters.base import NoDrafter  # noqa: E402
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest  # noqa: E402
from specdec_core.loop.requests import DecodeParams  # noqa: E402
from specdec_core.loop.speculation_budget import SpeculationBudget  # noqa: E402
from specdec_core.model.model_runner import ModelRunner
from tests.tiny_models import DigitsTokenizer, repetitive_prompt, tiny_llama  # noqa: E402

# Real models' architectures (their config.json values), built with random weights.
SHAPES = {
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                                   max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, rope_theta=1000000.0,
                                   max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True)),
}


def shaped_model(shape: str, device: str, dtype: torch.dtype):
    """A random-weight model with `shape`'s architecture on `device` (no EOS: every row runs to its length)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape == "tiny":
        return tiny_llama().model.to(device, dtype)
    model_type, values = SHAPES[shape]
    config = AutoConfig.for_model(model_type, bos_token_id=None, eos_token_id=None, pad_token_id=0, **values)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def shaped_runners(shape: str, device: str, dtype: torch.dtype, fast_forward: str) -> dict:
    """{label: ModelRunner} over one random model: the device's default forward, or (fast_forward "both") HF's
    modules and fast_forward.py side by side."""
    if shape == "tiny" and device == "cpu" and dtype == torch.float32 and fast_forward == "default":
        return {"ours ar": tiny_llama()}
    model = shaped_model(shape, device, dtype)
    choices = {"default": {"ours ar": None}, "on": {"ours ar": True}, "off": {"ours ar": False},
               "both": {"ours ar, HF modules": False, "ours ar, fast forward": True}}[fast_forward]
    runners = {label: ModelRunner(model, DigitsTokenizer(), f"random {shape}", device, dtype, fast_forward=choice)
               for label, choice in choices.items()}
    for label, runner in runners.items():
        if choices[label] and runner.fast is None:
            raise SystemExit(f"{label}: the fast forward does not cover this model")
    return runners


def ours(runner, prompts: list[list[int]], new_tokens: int, batch_size: int) -> tuple[float, float, list[list[int]]]:
    """-> (seconds per decode step after the prefill, the whole pass's seconds / new_tokens, each row's tokens)."""
    decoder = BatchDecoder(runner, max_batch=batch_size, budget=SpeculationBudget(enabled=False))
    for key, prompt in enumerate(prompts):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=new_tokens), NoDrafter()))
    admitted = time.perf_counter()
    decoder.admit()
    runner.synchronize()
    started, steps = time.perf_counter(), 0
    while decoder.rows:
        decoder.step()
        steps += 1
    runner.synchronize()
    errors = [result for _, result in decoder.finished if isinstance(result, str)]
    if errors:
        raise SystemExit(f"{len(errors)} rows failed, e.g. {errors[0]}")
    ended = time.perf_counter()
    got = {request.key: result.token_ids for request, result in decoder.finished}
    return (ended - started) / steps, (ended - admitted) / new_tokens, [got[key] for key in range(len(prompts))]


def hf(runner, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds per decode step of HF `generate` over the left-padded batch (its prefill included, as it is one of
    new_tokens forwards)."""
    ids, mask = left_padded(prompts)  # [n, longest], padding id 0
    ids, mask = ids.to(runner.device), mask.to(runner.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = runner.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, pad_token_id=0)
    runner.synchronize()
    return (time.perf_counter() - started) / new_tokens, out[:, ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's table of our steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="tiny", choices=["tiny", *SHAPES],
                        help="the random model's architecture (default: a 2-layer Llama, hidden 64)")
    parser.add_argument("--prompt-tokens", type=int, default=32,
                        help="mean prompt length; lengths spread over [n/2, 3n/2) (default 32)")
    parser.add_argument("--fast-forward", default="default", choices=["default", "on", "off", "both"],
                        help="our forward: the device's default, fast_forward.py, HF's modules, or both side by side")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    runners = shaped_runners(args.shape, args.device, dtype, args.fast_forward)
    n = args.prompt_tokens
    prompts = [repetitive_prompt(seed, n // 2 + (seed * 37) % max(1, n)) for seed in range(args.batch_size)]
    same = _equal_alone(runners, prompts[:4], dtype)
    ours_s, ours_pass, hf_s, agree = _rounds(runners, prompts, args)
    runner = next(iter(runners.values()))
    print(f"{hardware(args.device)}, dtype {args.dtype}, random {args.shape} "
          f"({runner.model.config.num_hidden_layers} layers, hidden {runner.model.config.hidden_size}), "
          f"batch {args.batch_size}, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.new_tokens} new tokens, best of {args.rounds}")
    rounds = lambda times: ", ".join(f"{s * 1e3:.2f}" for s in times)  # noqa: E731
    print(f"HF generate:  {min(hf_s) * 1e3:.2f} ms/step  (rounds: {rounds(hf_s)})")
    for label, times in ours_s.items():
        paired = sorted(h / o for h, o in zip(hf_s, times))
        print(f"{label}: {min(times) * 1e3:.2f} ms/step  (rounds: {rounds(times)}); rows equal to HF greedy alone "
              f"(first 4, 8 tokens) {same[label]}/4, to HF's padded batch {agree[label]}/{len(prompts)}"
              + ("" if dtype == torch.float32 else " (bf16/fp16: near-ties may flip)"))
        print(f"  / HF speed: {min(hf_s) / min(times):.2f}x (HF's time holds its prefill, ours does not); per round "
              f"(back to back) median {statistics.median(paired):.2f}x, range {paired[0]:.2f}-{paired[-1]:.2f}x; "
              f"whole pass, prefill included, per new token: {min(ours_pass[label]) * 1e3:.2f} ms, "
              f"{min(hf_s) / min(ours_pass[label]):.2f}x HF")
    if args.profile:
        _profile(runners, prompts, args)
    return 0


def _equal_alone(runners: dict, prompts: list[list[int]], dtype: torch.dtype) -> dict:
    """{label: how many of `prompts` its batched ar decodes (8 tokens) as HF greedy does each alone}; every one in
    fp32."""
    alone = [hf(next(iter(runners.values())), [p], 8)[1][0] for p in prompts]
    same = {}
    for label, each in runners.items():
        *_, tokens = ours(each, prompts, 8, len(prompts))
        same[label] = sum(a == b for a, b in zip(tokens, alone))
        if dtype == torch.float32:
            assert same[label] == len(prompts), f"{label} must equal HF greedy in fp32"
    return same


def _rounds(runners: dict, prompts: list[list[int]], args) -> tuple[dict, dict, list, dict]:
    """Each of ours, then HF, once per round after an untimed warm-up of each -> ({label: seconds per step per
    round}, {label: whole-pass seconds per new token per round}, HF's seconds per step per round, {label: rows equal
    to HF's padded batch in the last round})."""
    runner = next(iter(runners.values()))
    for each in runners.values():  # untimed: a GPU's first forwards of each shape pay for kernel choice and loading
        ours(each, prompts, 8, args.batch_size)
    hf(runner, prompts, 8)
    ours_s = {label: [] for label in runners}
    ours_pass = {label: [] for label in runners}
    agree, hf_s = {}, []
    for _ in range(args.rounds):
        outputs = {}
        for label, each in runners.items():
            seconds, whole, outputs[label] = ours(each, prompts, args.new_tokens, args.batch_size)
            ours_s[label].append(seconds)
            ours_pass[label].append(whole)
        seconds, hf_tokens = hf(runner, prompts, args.new_tokens)
        hf_s.append(seconds)
        agree = {label: sum(a == b for a, b in zip(tokens, hf_tokens)) for label, tokens in outputs.items()}
    return ours_s, ours_pass, hf_s, agree


def _profile(runners: dict, prompts: list[list[int]], args) -> None:
    """torch.profiler's table of 16 steps of each of ours (with the GPU's kernels on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    for label, each in runners.items():
        with profile(activities=activities) as prof:
            ours(each, prompts, 16, args.batch_size)
        print(label)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    raise SystemExit(main())
