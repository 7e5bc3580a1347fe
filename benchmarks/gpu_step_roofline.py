"""One decode or verify step against its memory roofline (issue 50): random weights of real models' shapes, so a GPU
machine needs no model files. For each shape, batch size and step width, on a cache of ~`--context` tokens a row:

  eager     the loop's path today: model_runner.forward_slots, then the argmax and greedy verification
  static    the graph-ready step (model/graph_step.py) run eagerly on its static buffers
  captured  the same step replayed from a CUDA graph (captured at its first use; the capture's seconds apart)
  compiled  the same, each layer's dense work fused by torch.compile (Inductor) before the capture (the first
            bucket's capture seconds hold the compile)
  hf        HF `generate`'s decode step over the same prompts (width 1: (a run of N tokens - a run of 1) / (N - 1))

Each of the step modes runs with each `--attention` (model/block_attention.py): `sdpa`, SDPA with a boolean or
float mask over every padded key, and `flex`, flex_attention (compiled) with a block mask that skips each row's dead
keys; a record's tokens are compared with the eager step's under the same attention. `--sampling` times the step
modes again with every row drawing on the device (`temperature`, or `top-p`: a sort of every node's logits; records
with a `sampling` field, not compared with the greedy eager step). `--prefill` also times one
prefill forward of `--batch-sizes`' first size prompts of ~`--context` tokens (lengths spread from 1/4 to the full
context, so a padded [b, T] block is ~3/8 padding) under each attention.

The roofline of a step is the bytes it must read (every weight once, the head included, and each row's cached keys
and values) over the bandwidth a large device copy reaches. Records go to `--out` as a JSON list of
{shape, batch_size, width, mode, step_ms, roofline_ms, roofline_ratio, device, torch, ...}; the table is printed.

  python benchmarks/gpu_step_roofline.py                  # a GPU: both shapes, batch 16 / 64 / 256, widths 1 2 4 8
  python benchmarks/gpu_step_roofline.py --attention flex --modes eager captured --prefill   # flex's turn
  python benchmarks/gpu_step_roofline.py --device cpu --dtype float32 --shapes tiny --batch-sizes 2 --widths 1 2 \\
      --context 40 --reps 2 --hf-new-tokens 3            # the mechanics, as the suite runs them
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.batch_bench import hardware  # noqa: E402
from benchmarks.host_overhead_bench import SHAPES, shaped_model  # noqa: E402
from specdec_core.loop.kv_cache import new_slot_cache  # noqa: E402
from specdec_core.loop.sampling import draw_nodes  # noqa: E402
from specdec_core.loop.verification import accept_greedy_chains, accept_greedy_nodes  # noqa: E402
from specdec_core.model import block_attention  # noqa: E402
from specdec_core.model.graph_step import GraphStep, Sampling  # noqa: E402
from specdec_core.model.model_runner import ModelRunner  # noqa: E402
from specdec_core.model.step_batch import StepBatch  # noqa: E402
from tests.tiny_models import DigitsTokenizer  # noqa: E402

DEFAULT_OUT = "benchmarks/results/gpu/step_roofline.json"
STEP_MODES = {"static": "eager", "captured": "captured", "compiled": "compiled"}  # mode -> GraphStep's
MODES = ("eager", *STEP_MODES, "hf")  # compiled last but one: its first compile is the slowest thing here


def copy_bandwidth(device: str) -> float:
    """Bytes a second a large device-to-device copy moves (read + write), best of 5."""
    size = (1 << 30) if device.startswith("cuda") else (1 << 28)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        started = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size / best


def step_bytes(runner: ModelRunner, lengths: list[int], width: int) -> int:
    """What one step must read: the decoder's and the head's weights once, and every row's keys and values (its
    cached ones and the step's new ones)."""
    model = runner.model
    decoder = runner.base_model
    weights = sum(p.numel() * p.element_size() for p in decoder.layers.parameters())
    weights += sum(p.numel() * p.element_size() for p in decoder.norm.parameters())
    head = model.get_output_embeddings().weight
    weights += head.numel() * head.element_size()
    fast = runner.fast
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    per_position = 2 * runner.num_layers * fast.kv_heads * fast.head_dim * itemsize
    return weights + per_position * sum(length + width for length in lengths)


def filled_cache(runner: ModelRunner, lengths: list[int], width: int):
    """A slot cache holding `lengths` positions a row of random keys and values (no prefill needed to time a step)."""
    cache = new_slot_cache(runner)
    cache.fit(len(lengths), max(lengths) + 2 * width + 1)
    generator = torch.Generator(device=runner.device).manual_seed(0)
    for length in lengths:
        cache.set_length(cache.add_row(), length)
    for buffers in (cache.keys, cache.values):
        for buffer in buffers:
            buffer.normal_(generator=generator)
    return cache


def chain_step(lengths: list[int], width: int, vocab: int, seed: int) -> tuple[StepBatch, torch.Tensor]:
    """Every row's pending token and a chain of width - 1 random draft tokens -> (the StepBatch, step_ids [B, T])."""
    rows = len(lengths)
    step_ids = torch.randint(0, vocab, (rows, width), generator=torch.Generator().manual_seed(seed))
    positions = torch.tensor(lengths)[:, None] + torch.arange(width)  # [B, T]
    visible = torch.ones(width, width, dtype=torch.bool).tril().expand(rows, width, width).clone()  # [B, T, T]
    logit_index = torch.stack([torch.arange(rows).repeat_interleave(width), torch.arange(width).repeat(rows)], 1)
    return StepBatch(step_ids, positions, visible, logit_index), step_ids


def eager_step(runner: ModelRunner, cache, batch: StepBatch, step_ids: torch.Tensor) -> list[list[int]]:
    """The loop's step today: the forward, one argmax over the logits, greedy chains verified, one copy back."""
    logits = runner.forward_slots(cache, batch)  # [B T, vocab]
    real = torch.ones_like(step_ids, dtype=torch.bool)
    accepted, token = accept_greedy_chains(step_ids, real, logits.argmax(dim=-1))
    return torch.stack([accepted, token], 1).tolist()


def timed(run, device: str, reps: int) -> tuple[float, object]:
    """Median milliseconds of `run` over reps (after two untimed runs) -> (ms, its last output)."""
    out = None
    for _ in range(2):
        out = run()
    times = []
    for _ in range(reps):
        _sync(device)
        started = time.perf_counter()
        out = run()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, out


def syncs_in(run, device: str) -> int | None:
    """How many synchronising calls one run makes (CUDA's sync debug mode; None on a CPU)."""
    if not device.startswith("cuda"):
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def hf_step_ms(runner: ModelRunner, lengths: list[int], new_tokens: int) -> float:
    """HF `generate`'s decode step at this batch: (a run of new_tokens - a run of 1) / (new_tokens - 1), best of 2."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, runner.vocab_size, (len(lengths), max(lengths)), generator=generator).to(runner.device)
    mask = torch.ones_like(ids)

    def run(count: int) -> float:
        _sync(runner.device)
        started = time.perf_counter()
        with torch.inference_mode():
            runner.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=count,
                                  min_new_tokens=count, pad_token_id=0)
        _sync(runner.device)
        return time.perf_counter() - started

    run(2)  # untimed: the first call pays for kernel choice
    whole = min(run(new_tokens) for _ in range(2))
    first = min(run(1) for _ in range(2))
    return max(whole - first, 0.0) / (new_tokens - 1) * 1e3


def prefill_ms(runner: ModelRunner, lengths: list[int], reps: int, device: str) -> float:
    """One prefill forward of prompts of `lengths` tokens, padded to [b, max], from an empty cache (median ms)."""
    rows, width = len(lengths), max(lengths)
    cache = new_slot_cache(runner)
    cache.fit(rows, width + 1)
    for _ in lengths:
        cache.add_row()
    ids = torch.randint(1, runner.vocab_size, (rows, width), generator=torch.Generator().manual_seed(2))
    news = torch.tensor(lengths)
    real = torch.arange(width)[None, :] < news[:, None]  # [b, T]
    visible = torch.ones(width, width, dtype=torch.bool).tril() & real[:, None, :] & real[:, :, None]
    batch = StepBatch(ids, torch.arange(width).expand(rows, width).clone(), visible,
                      torch.stack([torch.arange(rows), news - 1], 1), prefill=True)
    return timed(lambda: runner.forward_slots(cache, batch), device, reps)[0]


def measure(shape: str, runner: ModelRunner, args, bandwidth: float, emit) -> None:
    """Time every (batch size, width, attention, mode) of one shape; each record goes to `emit` as it is made."""
    base = {"shape": shape, "device": hardware(args.device), "torch": torch.__version__, "dtype": args.dtype,
            "context": args.context}
    for batch_size in args.batch_sizes:
        lengths = [args.context + (row * 37) % max(1, args.context // 8) for row in range(batch_size)]
        for width in args.widths:
            cache = filled_cache(runner, lengths, width)
            batch, step_ids = chain_step(lengths, width, runner.vocab_size, seed=width)
            roofline_ms = step_bytes(runner, lengths, width) / bandwidth * 1e3
            for attention in args.attention:
                runner.gpu_attention = attention  # the eager forward's, and each graph-ready step's below
                steps = {mode: GraphStep(runner, STEP_MODES[mode]) for mode in args.modes if mode in STEP_MODES}
                runs = {"eager": lambda: eager_step(runner, cache, batch, step_ids)}  # the reference: always run
                runs.update({mode: (lambda step=step: step.run(cache, batch, step_ids, accept_greedy_nodes))
                             for mode, step in steps.items()})
                outputs = {}
                for mode, run in runs.items():
                    step_ms, out = timed(run, args.device, args.reps)
                    outputs[mode] = [(row[0], row[-1]) for row in out]  # (accepted, next token) a row
                    record = {**base, "batch_size": batch_size, "width": width, "mode": mode, "attention": attention,
                              "step_ms": round(step_ms, 4), "roofline_ms": round(roofline_ms, 4),
                              "roofline_ratio": round(step_ms / roofline_ms, 2),
                              "same_tokens_as_eager": outputs[mode] == outputs["eager"]}
                    if attention == "flex":  # compiled, or masked SDPA after its kernel failed
                        record["flex_kernel"] = block_attention.kernel_state(args.device)
                    if mode in ("captured", "compiled"):
                        step = steps[mode]
                        record.update(captured=step.captures > 0, capture_s=round(step.capture_s, 3),
                                      syncs_per_step=syncs_in(run, args.device))
                    emit(record)
                for kind in args.sampling:  # the same steps, every row drawing on the device (seeded)
                    sampling = Sampling([0.8] * batch_size, [0] * batch_size,
                                        [0.9 if kind == "top-p" else 1.0] * batch_size, list(range(batch_size)),
                                        draw_nodes)
                    for mode, step in steps.items():
                        run = (lambda step=step: step.run(cache, batch, step_ids, accept_greedy_nodes, sampling))
                        step_ms, _ = timed(run, args.device, args.reps)
                        record = {**base, "batch_size": batch_size, "width": width, "mode": mode,
                                  "attention": attention, "sampling": kind, "step_ms": round(step_ms, 4),
                                  "roofline_ms": round(roofline_ms, 4),
                                  "roofline_ratio": round(step_ms / roofline_ms, 2)}
                        if attention == "flex":
                            record["flex_kernel"] = block_attention.kernel_state(args.device)
                        if mode in ("captured", "compiled"):
                            record.update(captured=step.captures > 0, capture_s=round(step.capture_s, 3),
                                          syncs_per_step=syncs_in(run, args.device))
                        emit(record)
            del cache
        if "hf" in args.modes and 1 in args.widths:
            step_ms = hf_step_ms(runner, lengths, args.hf_new_tokens)
            roofline_ms = step_bytes(runner, lengths, 1) / bandwidth * 1e3
            record = {**base, "batch_size": batch_size, "width": 1, "mode": "hf", "step_ms": round(step_ms, 4),
                      "roofline_ms": round(roofline_ms, 4), "roofline_ratio": round(step_ms / roofline_ms, 2)}
            emit(record)
    if args.prefill:
        rows = args.batch_sizes[0]
        lengths = [args.context // 4 + (row * 3 * args.context // 4) // max(1, rows - 1) for row in range(rows)]
        for attention in args.attention:
            runner.gpu_attention = attention
            step_ms = prefill_ms(runner, lengths, args.reps, args.device)
            record = {**base, "batch_size": rows, "width": max(lengths), "mode": "prefill", "attention": attention,
                      "step_ms": round(step_ms, 4), "prompt_tokens": sum(lengths),
                      "tokens_per_s": round(sum(lengths) / step_ms * 1e3)}
            if attention == "flex":
                record["flex_kernel"] = block_attention.kernel_state(args.device)
            emit(record, echo=False)
            print(f"{shape:>13} b{rows:<4} prefill {attention:>5}: {step_ms:9.3f} ms  {sum(lengths)} tokens, "
                  f"{record['tokens_per_s']} tok/s" + (f", flex_attention {record['flex_kernel']}"
                                                       if "flex_kernel" in record else ""), flush=True)


def _print(record: dict) -> None:
    extra = "" if "captured" not in record else (
        f"  captured {record['captured']} in {record['capture_s']:.2f} s, syncs {record['syncs_per_step']}")
    same = "" if "same_tokens_as_eager" not in record else f"  same tokens as eager: {record['same_tokens_as_eager']}"
    attention = f" {record['attention']:>4}" if "attention" in record else ""
    attention += f" {record['sampling']}" if "sampling" in record else ""
    print(f"{record['shape']:>13} b{record['batch_size']:<4} T{record['width']:<3} {record['mode']:>9}{attention}: "
          f"{record['step_ms']:9.3f} ms  roofline {record['roofline_ms']:8.3f} ms  x{record['roofline_ratio']:<7}"
          f"{same}{extra}" + (f"  flex_attention {record['flex_kernel']}" if "flex_kernel" in record else ""),
          flush=True)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=["tiny", *SHAPES])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--context", type=int, default=500, help="cached tokens a row (rows spread up to +1/8)")
    parser.add_argument("--reps", type=int, default=10, help="timed runs of each step (the median is kept)")
    parser.add_argument("--hf-new-tokens", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="what to time (eager is always timed: the others are compared with it)")
    parser.add_argument("--attention", nargs="+", default=["sdpa"],
                        choices=block_attention.CANDIDATES + block_attention.OPT_IN,
                        help="the steps' attention: masked SDPA, flex_attention with a block mask, the split kernels "
                             "(graph-ready steps only; the eager step then runs SDPA)")
    parser.add_argument("--prefill", action="store_true", help="also time a prefill forward under each attention")
    parser.add_argument("--sampling", nargs="*", default=[], choices=["temperature", "top-p"],
                        help="also time the graph-ready steps with every row sampling: at temperature 0.8, or with "
                             "top-p 0.9 too (a sort of every node's logits)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: pass --device cpu to check the mechanics")
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(args.device)
    print(f"{hardware(args.device)}, torch {torch.__version__}, {args.dtype}, copy bandwidth {bandwidth / 1e9:.1f} GB/s,"
          f" ~{args.context} cached tokens a row, median of {args.reps}")
    records = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def emit(record: dict, echo: bool = True) -> None:  # written at once: a run cut short keeps what it timed
        records.append(record)
        out.write_text(json.dumps(records, indent=1) + "\n")
        if echo:
            _print(record)

    for shape in args.shapes:
        model = shaped_model(shape, args.device, dtype)
        runner = ModelRunner(model, DigitsTokenizer(), f"random {shape}", args.device, dtype, fast_forward=True)
        if runner.fast is None:
            raise SystemExit(f"{shape}: the fast forward does not cover it")
        measure(shape, runner, args, bandwidth, emit)
        del runner, model
        torch._dynamo.reset()  # the next shape's compiled functions start specialised again
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"wrote {len(records)} records to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
