"""Refine a retrieval corpus for `rest` / `spectra+retrieval`: score every text's perplexity under the target model
(a Ray Data actor pool, batched), keep the lowest-perplexity texts (SPECTRA §3.2) and build their index.

    python jobs/refine_corpus.py --input corpus:stdlib --output refined/ --keep 2000
    python jobs/summarize.py --method spectra+retrieval --retrieval-index refined/index ...

Writes OUTPUT/corpus.parquet (id, token count, perplexity, kept, error per text), OUTPUT/index/ and its manifest, and
the per-call scores under OUTPUT/scores/ that --resume continues from. Texts that are empty, undecodable or
unscorable are error rows, never a failed job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jobs.common  # noqa: E402,F401  (sets the offline environment before anything loads)
from jobs.common import report_validation_error
from operators.read_corpus import check_corpus_source
from pipelines.generate import init_ray
from pipelines.outputs import RunLockedError
from specdec_core.cli import OneLineParser
from specdec_core.errors import SpecbatchError
from specdec_core.model.model_registry import DEFAULT_MODEL, check_model_available, resolve_model_path
from specdec_core.prompts import tokenizer_fingerprint


def build_parser():
    parser = OneLineParser(prog="refine_corpus.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True,
                        help="a JSONL file (one text per line in --text-field), a Parquet file or directory "
                             "(the --text-field column), a directory of text files (--glob), hf:DIR "
                             "(datasets.save_to_disk) or a shipped corpus: corpus:stdlib, corpus:aclsum, "
                             "corpus:mtbench-answers")
    parser.add_argument("--output", required=True, help="output directory (new, empty, or a refinement to --resume)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target model: registry name or HF directory "
                                                               "(its tokenizer makes the index; default %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet or dataset column holding the "
                                                             "text (default %(default)s)")
    parser.add_argument("--id-field", default="id", help="the text's id, when the rows have one (default %(default)s)")
    parser.add_argument("--glob", default="*.txt", help="directory input: files to read, recursively "
                                                        "(default %(default)s)")
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument("--keep", type=int, default=None, help="keep this many texts, the lowest perplexities first")
    keep.add_argument("--keep-fraction", type=float, default=None,
                      help="keep this share of the scored texts (default 0.5 when no other --keep* is given)")
    keep.add_argument("--keep-tokens", type=int, default=None,
                      help="keep texts (the lowest perplexities first, or at random) while their tokens add up to at "
                           "most this: an index of a chosen size, and a refined and a random index of equal size")
    parser.add_argument("--selection", default="lowest_ppl", choices=["lowest_ppl", "random"],
                        help="random: as many texts (or tokens) drawn at random (the unrefined baseline of the paper's "
                             "ablation)")
    parser.add_argument("--seed", type=int, default=0, help="--selection random's seed (default %(default)s)")
    parser.add_argument("--window", type=int, default=1024,
                        help="a longer text is scored in windows of this many tokens (default %(default)s)")
    parser.add_argument("--overlap", type=int, default=128,
                        help="context tokens each later window starts with (default %(default)s)")
    parser.add_argument("--tokens-per-forward", type=int, default=1024,
                        help="padded tokens per scoring forward (default %(default)s)")
    parser.add_argument("--max-text-tokens", type=int, default=1 << 20, help="a longer text is an error row")
    parser.add_argument("--rows-per-call", type=int, default=1024,
                        help="texts per actor call, also what a crash can lose (default %(default)s)")
    parser.add_argument("--num-actors", type=int, default=1, help="scoring actors (each loads the model once)")
    parser.add_argument("--cpus-per-actor", type=float, default=None)
    parser.add_argument("--num-gpus-per-actor", type=float, default=0.0)
    parser.add_argument("--limit", type=int, default=None, help="the first N texts only")
    parser.add_argument("--resume", action="store_true",
                        help="continue a refinement in --output: texts already scored are skipped, the selection "
                             "and the index are rebuilt (so --resume with another --keep only re-selects)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: embedded local Ray)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError


    args = build_parser().parse_args(argv)
    try:
        from pipelines.refine import RefineConfig, check_output  # lazy: ray

        config = RefineConfig(**{k: v for k, v in vars(args).items() if k != "address"})
        check_corpus_source(config.input)
        check_model_available(config.model)
        from transformers import AutoTokenizer  # after the cheap checks: a bad argument fails in under a second


        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
        settings = config.score_settings(tokenizer_fingerprint(tokenizer))
        check_output(config, settings)
    except (ValidationError, SpecbatchError, OSError) as exc:
        return report_validation_error("refine_corpus", exc)

    from pipelines.refine import run_refinement  # lazy: ray

    init_ray(args.address, output=config.output)
    try:
        summary = run_refinement(config, settings)
    except (RunLockedError, SpecbatchError) as exc:
        return report_validation_error("refine_corpus", exc)
    rate = summary["tokens"] / summary["scoring_s"] if summary["scored_this_run"] else None
    print(f"{summary['texts']} texts ({summary['errors']} errors, {summary['scored_this_run']} scored now), kept "
          f"{summary['kept']} with {summary['kept_tokens']} tokens (perplexity <= {summary['max_kept_ppl']}); "
          f"index: {summary['index']}", file=sys.stderr)
    print(json.dumps({**summary, "scoring_s": round(summary["scoring_s"], 1), "wall_s": round(summary["wall_s"], 1),
                      "tokens_per_s": None if rate is None else round(rate, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
