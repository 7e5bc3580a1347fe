"""Drafters with another tokenizer (issue 11): our `slem` against Hugging Face's universal assisted generation
(`generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)`), both at batch 1, with plain greedy
`generate` and our `ar` as the baselines; one run, side by side.

    python benchmarks/cross_vocab_bench.py --model qwen2.5-coder-1.5b --drafter smollm2-135m --requests 4

Prompts: HumanEval's first N (raw completion prompts, the same ids for every system). Every system decodes
--max-new-tokens greedily; `= ar` counts outputs identical to our ar.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--drafter", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-tokens", type=int, default=4, help="slem's drafter tokens per step")
    parser.add_argument("--adaptive", action="store_true", help="slem adapts its draft length")
    parser.add_argument("--no-budget", action="store_true", help="slem verifies every draft (no speculation budget)")
    parser.add_argument("--systems", nargs="+", default=["ar", "slem", "hf_greedy", "hf_universal_assisted"])
    args = parser.parse_args()

    import torch

    from benchmarks.batch_bench import hardware
    from corpora.code_edit import humaneval_rows
    from specdec_core.decode import DecodeParams
    from specdec_core.engine import Engine, EngineConfig

    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu", drafter=args.drafter))
    target, draft = engine.target, engine.draft_model
    prompts = [engine.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
               for row in humaneval_rows(args.requests)]
    params = DecodeParams(max_new_tokens=args.max_new_tokens)
    overlap = engine.vocab_mapping().overlap() if not engine.same_vocabulary else None

    from specdec_core.engine import BatchItem
    from specdec_core.methods import MethodOptions

    options = MethodOptions(draft_tokens=args.draft_tokens, adaptive=args.adaptive)

    def ours(method):
        outputs, started, forwards = [], time.perf_counter(), 0
        for ids in prompts:  # batch 1, one request after the other
            [(_, result)] = list(engine.decode_batch([BatchItem(0, ids, params)], method, options, batch_size=1,
                                                     speculation_budget=not args.no_budget))
            outputs.append(result["output_token_ids"])
            forwards += result["target_forwards"]
        return outputs, time.perf_counter() - started, forwards

    def hf(assisted: bool):
        outputs, started = [], time.perf_counter()
        extra = {"assistant_model": draft.model, "tokenizer": target.tokenizer,
                 "assistant_tokenizer": draft.tokenizer} if assisted else {}
        with torch.inference_mode():
            for ids in prompts:
                out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                            do_sample=False, max_new_tokens=args.max_new_tokens,
                                            min_new_tokens=args.max_new_tokens, pad_token_id=target.tokenizer.pad_token_id
                                            or 0, **extra)
                outputs.append(out[0, len(ids):].tolist())
        return outputs, time.perf_counter() - started, None

    results = {}
    systems = {"ar": lambda: ours("ar"), "slem": lambda: ours("slem"), "hf_greedy": lambda: hf(False),
               "hf_universal_assisted": lambda: hf(True)}
    for name in args.systems:
        run = systems[name]
        outputs, wall, forwards = run()
        tokens = sum(len(o) for o in outputs)
        results[name] = {"tokens": tokens, "wall_s": round(wall, 1), "tok_s": round(tokens / wall, 2),
                         "mean_accepted_length": round(tokens / forwards, 2) if forwards else None,
                         "outputs": outputs}
        print(json.dumps({"system": name, **{k: v for k, v in results[name].items() if k != "outputs"}}), flush=True)
    reference = results["ar"]["outputs"]
    print(f"\n# {args.model} <- {args.drafter}, dtype {target.dtype_name}, {hardware('cpu')}, {len(prompts)} HumanEval "
          f"prompts x {args.max_new_tokens} new tokens, batch 1, one run; slem {args.draft_tokens} drafter tokens"
          f"{', adaptive' if args.adaptive else ''}{', no budget' if args.no_budget else ''}; vocabulary overlap "
          f"{overlap}\n")
    peer = results.get("hf_universal_assisted")
    print("| system | tok/s | x ar | x HF assisted | MAL | = ar |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        same = sum(a[: len(b)] == b[: len(a)] for a, b in zip(r["outputs"], reference))
        print(f"| {name} | {r['tok_s']} | {r['tok_s'] / results['ar']['tok_s']:.2f} | "
              f"{r['tok_s'] / peer['tok_s'] if peer else float('nan'):.2f} | {r['mean_accepted_length'] or ''} | "
              f"{same}/{len(prompts)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
