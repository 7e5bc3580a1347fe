"""Corpus refinement throughput: the whole refine_corpus.py job against the model's raw batched forward on the same
texts (the target: the job reaches >= 80 % of it).

    python benchmarks/refine_bench.py --input corpus:aclsum --limit 1500 --output /tmp/refine_bench

Raw forward: the same texts, tokenized, cut into the same windows and packed into the same forwards as the job's
scorer (operators/perplexity.py), each forward a plain `model(input_ids, attention_mask)` with full logits, in this
process with the actor's thread count; nothing else is timed (no reading, tokenizing, loss, Ray, writing). The job
runs as a subprocess (embedded Ray, one scoring actor) and is timed three ways:
- end to end, from launch to exit (Python and Ray start, model load, index build included);
- its scoring stage (the job's own `scoring_s`: the actor's start and model load included);
- steady state: the tokens of the score parts after the first, over the seconds between the first part's write and
  the last's (the parts are renamed into place when a call finishes, so their mtimes are the calls' ends). This is
  what a large corpus approaches, where the fixed start and finish are small.
Raw and job run one after the other, never at once, in --rounds interleaved rounds (a 2-core machine's speed drifts
by ~10 % between minutes: compare within a round). Tokens = the texts' tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.batch_bench import hardware
from operators.perplexity import PerplexityScorer, pack_windows
from operators.read_corpus import corpus_items, parse_item
from specdec_core.defaults import DEFAULT_MODEL  # noqa: E402
from specdec_core.model.model_runner import ModelRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def corpus_tokens(source: str, limit: int, tokenizer, glob: str) -> list[list[int]]:
    """The first `limit` texts the job reads, tokenized as its scorer does (error rows dropped)."""
    ids = []
    for item in corpus_items(source, glob):
        for row in parse_item(item):
            if len(ids) + 1 > limit:
                return [t for t in ids if t is not None]
            tokens = tokenizer(row["text"], add_special_tokens=False)["input_ids"] if row["error"] is None else None
            ids.append(tokens if tokens is not None and len(tokens) >= 2 else None)
    return [t for t in ids if t is not None]


def raw_forward_seconds(runner, token_lists, window: int, overlap: int, tokens_per_forward: int) -> float:
    import torch


    scorer = PerplexityScorer(runner, window, overlap, tokens_per_forward)
    batches = pack_windows(scorer.windows(token_lists), tokens_per_forward)
    inputs = []
    for batch in batches:
        width = batch[0].length
        ids = torch.full((len(batch), width), scorer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            ids[row, : w.length] = torch.tensor(token_lists[w.text][w.begin:w.end])
            mask[row, : w.length] = 1
        inputs.append((ids, mask))
    with torch.inference_mode():
        runner.model(input_ids=inputs[0][0][:1, :16], attention_mask=inputs[0][1][:1, :16])  # warm-up
        started = time.perf_counter()
        for ids, mask in inputs:
            runner.model(input_ids=ids, attention_mask=mask).logits.float()
        return time.perf_counter() - started


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="corpus:aclsum")
    parser.add_argument("--glob", default="*.txt")
    parser.add_argument("--limit", type=int, default=1500)
    parser.add_argument("--output", required=True, help="a new directory: round N's job writes OUTPUT/roundN")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--overlap", type=int, default=128)
    parser.add_argument("--tokens-per-forward", type=int, default=1024)
    parser.add_argument("--keep-fraction", type=float, default=0.5)
    parser.add_argument("--rows-per-call", type=int, default=1024, help="the job's texts per actor call")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved raw / job rounds (default %(default)s)")
    return parser


def main() -> int:
    args = _parser().parse_args()

    import torch


    torch.set_num_threads(os.cpu_count() or 1)  # the job's one actor gets round(CPUs - 0.5) threads: all of them
    runner = ModelRunner.load(args.model, args.dtype, "cpu")
    token_lists = corpus_tokens(args.input, args.limit, runner.tokenizer, args.glob)
    dtype = runner.dtype_name  # what --dtype auto became (the job's actor resolves it the same way)
    print(f"# {args.model}, dtype {dtype}, {hardware('cpu')}, window {args.window}, overlap {args.overlap}, "
          f"{args.tokens_per_forward} tokens per forward, {args.rows_per_call} texts per call, "
          f"{args.rounds} interleaved round(s)")
    rounds = []
    for index in range(args.rounds):
        raw_s = raw_forward_seconds(runner, token_lists, args.window, args.overlap, args.tokens_per_forward)
        result = _job_round(args, index, raw_s, token_lists)
        if result is None:
            return 1
        rounds.append(result)
        print(json.dumps(result), flush=True)
    for name, label in (("job_vs_raw", "job end to end"), ("scoring_vs_raw", "its scoring stage"),
                        ("steady_vs_raw", "steady state")):
        values = [r[name] for r in rounds if r[name] is not None]
        print(f"{label}: {', '.join(f'{v:.2f}' for v in values)}x raw"
              + (f" (median {statistics.median(values):.2f})" if values else ""))
    return 0


def _job_round(args, index: int, raw_s: float, token_lists: list) -> dict | None:
    """Run the refinement job once into OUTPUT/round<index + 1> -> its timings against the raw forwards' `raw_s`
    (None, with its stderr printed, if the job failed)."""
    output = Path(args.output) / f"round{index + 1}"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "refine_corpus.py"), "--input", args.input,
                           "--glob", args.glob, "--limit", str(args.limit), "--output", str(output), "--model",
                           args.model, "--dtype", args.dtype, "--window", str(args.window), "--overlap",
                           str(args.overlap), "--tokens-per-forward", str(args.tokens_per_forward),
                           "--keep-fraction", str(args.keep_fraction), "--rows-per-call", str(args.rows_per_call)],
                          capture_output=True, text=True, cwd=ROOT)
    job_s = time.perf_counter() - started
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return None
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    steady_tokens, steady_s = steady_state(output)
    tokens = sum(len(t) for t in token_lists)
    return {"round": index + 1, "input": args.input, "texts": len(token_lists), "tokens": tokens,
            "job_tokens": summary["tokens"], "raw_forward_s": round(raw_s, 1),
            "raw_tok_s": round(tokens / raw_s, 1), "job_wall_s": round(job_s, 1),
            "job_tok_s": round(tokens / job_s, 1), "job_scoring_s": summary["scoring_s"],
            "job_scoring_tok_s": round(tokens / summary["scoring_s"], 1),
            "steady_tok_s": round(steady_tokens / steady_s, 1) if steady_s else None,
            "job_vs_raw": round(raw_s / job_s, 3), "scoring_vs_raw": round(raw_s / summary["scoring_s"], 3),
            "steady_vs_raw": round(steady_tokens / steady_s / (tokens / raw_s), 3) if steady_s else None,
            "kept": summary["kept"], "kept_tokens": summary["kept_tokens"],
            "max_kept_ppl": summary["max_kept_ppl"]}


def steady_state(output: Path) -> tuple[int, float]:
    """-> (tokens of the score parts after the first, seconds from the first part's write to the last's); (0, 0.0)
    with fewer than two parts."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    parts = sorted((output / "scores").glob("part-*.parquet"), key=lambda p: p.stat().st_mtime)
    if len(parts) < 2:
        return 0, 0.0
    tokens = sum(pc.sum(pq.read_table(p, columns=["token_count"]).column("token_count")).as_py() or 0
                 for p in parts[1:])  # error rows have no token count
    return tokens, parts[-1].stat().st_mtime - parts[0].stat().st_mtime


if __name__ == "__main__":
    sys.exit(main())
