"""The owned cache and the batched loop on an accelerator: tiny random Llama and Gemma3 (sliding window) in fp32 on
`--device` (default cuda); every row of batched ar / copyspec / copyspec trees must equal the model's own greedy
`generate` on that device, through HF's modules and through fast_forward.py (where it covers the model), its steps
eager and graph-ready (model/graph_step.py: captured on a GPU, and compiled), with masked SDPA, with flex_attention
(model/block_attention.py), with the faster of the two at the first capture (`auto`) and with the split kernels
(kernels/split_kv_attention.py). Then seeded sampling rows (temperature 0.8, some with top-p 0.9; a peaked head):
copyspec chains and trees through the graph-ready step's draws on the device must give each row the tokens `ar`
gives through the eager forward and the host's draws (sampling.PositionDraws). CI has no GPU, so this is run by hand
on a lent GPU machine (exit status 1 on a mismatch).

  python benchmarks/device_check.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec_core.drafters.base import NoDrafter  # noqa: E402
from specdec_core.drafters.copyspec import CopySpecDrafter  # noqa: E402
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest  # noqa: E402
from specdec_core.loop.requests import DecodeParams  # noqa: E402
from specdec_core.loop.sampling import SamplingParams  # noqa: E402
from specdec_core.model.graph_step import step_mode  # noqa: E402
from specdec_core.model.model_runner import ModelRunner  # noqa: E402


def main() -> int:
    import torch

    from tests.tiny_models import repetitive_prompt, tiny_gemma3, tiny_llama  # lazy: the checkout's tests folder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--graph-modes", nargs="+", default=None, choices=["off", "default", "compiled"],
                        help="check only the variants whose graph-ready steps run so (default: every variant; the "
                             "sampling rows run the device's default steps)")
    args = parser.parse_args()
    device = args.device
    drafters = {"ar": NoDrafter, "copyspec": lambda: CopySpecDrafter(gamma=2, copy_tokens=6),
                "copyspec --candidates 3": lambda: CopySpecDrafter(gamma=2, copy_tokens=6, candidates=3)}
    failures = 0
    # (model, fast forward, graph-ready steps: the device's default, which on a GPU captures them, or off; attention)
    variants = ((tiny_llama(), False, "off", "sdpa"), (tiny_llama(), True, "off", "sdpa"),
                (tiny_llama(), True, None, "sdpa"), (tiny_llama(), True, None, "flex"),
                (tiny_llama(), True, None, "auto"), (tiny_llama(), True, None, "split"),
                (tiny_llama(), True, "compiled", "sdpa"),
                (tiny_llama(), True, "compiled", "flex"), (tiny_gemma3(), False, "off", "sdpa"))
    for cpu_runner, fast, graph_mode, attention in variants:
        if args.graph_modes is not None and (graph_mode or "default") not in args.graph_modes:
            continue
        runner = ModelRunner(cpu_runner.model.to(device), cpu_runner.tokenizer, cpu_runner.name, device, torch.float32,
                             fast_forward=fast)
        runner.graph_mode = graph_mode or runner.graph_mode
        runner.gpu_attention = attention
        if fast and runner.fast is None:
            print(f"{runner.name}: the fast forward does not cover it")
            failures += 1
            continue
        forward = "fast forward" if runner.fast is not None else "HF modules"
        forward += f", graph-ready steps {runner.graph_mode}, {attention}" if runner.fast is not None else ""
        prompts = [repetitive_prompt(seed, n) for seed, n in enumerate([5, 23, 11, 40, 17])]
        expected = []
        for prompt in prompts:
            with torch.inference_mode():
                out = runner.model.generate(torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=14,
                                            min_new_tokens=14, pad_token_id=0,
                                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device))
            expected.append(out[0, len(prompt):].tolist())
        for name, make in drafters.items():
            decoder = BatchDecoder(runner, max_batch=3)
            for key, prompt in enumerate(prompts):
                decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=14), make()))
            got = {request.key: result for request, result in decoder.run()}
            same = sum(not isinstance(got[k], str) and got[k].token_ids == expected[k] for k in range(len(prompts)))
            failures += same != len(prompts)
            graph = runner.graph_step()
            steps = f"; {graph.summary()}" if graph is not None else ""
            print(f"{runner.name} ({forward}) {name} on {device}: {same}/{len(prompts)} rows equal HF greedy "
                  f"(drafted {decoder.stats.drafted_tokens}, accepted {decoder.stats.accepted_tokens}){steps}"
                  + ("" if same == len(prompts) else f"; errors: {[g for g in got.values() if isinstance(g, str)]}"))
    if args.graph_modes is None or "default" in args.graph_modes:
        failures += sampling_check(device, drafters, tiny_llama(), repetitive_prompt)
    return 1 if failures else 0


def sampling_check(device: str, drafters: dict, cpu_runner: ModelRunner, repetitive_prompt) -> int:
    """Seeded sampling rows: each drafter's rows through the device's default graph-ready steps against `ar`'s rows
    through the eager forward (graph-ready steps off), tokens compared row by row. -> 1 on a mismatch, else 0."""
    import torch

    with torch.no_grad():
        cpu_runner.model.lm_head.weight.mul_(30.0)  # peaked, as a trained model's: sampled rows repeat, drafts accepted
    runner = ModelRunner(cpu_runner.model.to(device), cpu_runner.tokenizer, cpu_runner.name, device, torch.float32)
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate([5, 23, 11, 40, 17])]
    outputs = {}
    for name, make in drafters.items():
        runner.graph_mode = "off" if name == "ar" else runner.graph_mode
        decoder = BatchDecoder(runner, max_batch=3)
        for key, prompt in enumerate(prompts):
            params = DecodeParams(max_new_tokens=24, sampling=SamplingParams(temperature=0.8, seed=key,
                                                                             top_p=0.9 if key % 2 else 1.0))
            decoder.submit(DecodeRequest(key, prompt, params, make()))
        got = {request.key: result for request, result in decoder.run()}
        outputs[name] = [got[k].token_ids if not isinstance(got[k], str) else got[k] for k in range(len(prompts))]
        runner.graph_mode = step_mode(device)
        graph = runner.graph_step()
        steps = f"; {graph.summary()}" if graph is not None and name != "ar" else ""
        same = sum(a == b for a, b in zip(outputs[name], outputs["ar"]))
        print(f"{runner.name} seeded sampling {name} on {device}: {same}/{len(prompts)} rows equal ar's "
              f"(drafted {decoder.stats.drafted_tokens}, accepted {decoder.stats.accepted_tokens}){steps}")
        if same != len(prompts):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
