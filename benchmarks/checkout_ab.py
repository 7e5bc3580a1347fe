"""The same engine workload in whichever checkout this is run from: tok/s per timed pass and a digest of every
output's token ids. Run it from two checkouts (a refactor and its base) one after the other, in both orders, and
compare: equal digests mean equal tokens, and the tok/s spread of one checkout says how much of a difference is noise.

    cd ../base && /path/to/.venv/bin/python /path/to/benchmarks/checkout_ab.py
    cd ../work && .venv/bin/python benchmarks/checkout_ab.py

Works with any checkout whose engine has Engine, EngineConfig, BatchItem and DecodeParams (the public names)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())  # the checkout run from, not the one this file is in

import specdec_core  # noqa: E402
from benchmarks.batch_bench import hardware  # noqa: E402  (the same line in any checkout)
from corpora.code_edit import stdlib_rename_tasks  # noqa: E402
from specdec_core import DecodeParams, Engine, EngineConfig  # noqa: E402
from specdec_core.engine import BatchItem  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["ar", "copyspec"])
    parser.add_argument("--requests", type=int, default=16, help="stdlib rename tasks (code edits)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="timed passes of each method, after one untimed")
    return parser


def timed_pass(engine, prompts: list[list[int]], method: str, args) -> tuple[float, str]:
    """-> (tok/s of the pass, sha256 prefix of every output's token ids in request order)."""
    items = [BatchItem(i, ids, DecodeParams(max_new_tokens=args.new_tokens)) for i, ids in enumerate(prompts)]
    # each pass as a new job's: else `suffix` drafts from the job memory of the earlier passes over the same prompts
    getattr(engine, "forget", lambda: None)()
    started = time.perf_counter()
    results = dict(engine.decode_batch(items, method, batch_size=args.batch_size))
    seconds = time.perf_counter() - started
    ids = [results[i]["output_token_ids"] for i in range(len(prompts))]
    return sum(map(len, ids)) / seconds, hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:12]


def main() -> int:
    args = _parser().parse_args()
    engine = Engine(EngineConfig())
    print(f"# checkout {os.path.dirname(specdec_core.__file__)}; dtype {engine.target.dtype}; {hardware('cpu')}",
          flush=True)
    prompts = [engine.prompt_ids(row["prompt"], None, False) for row in stdlib_rename_tasks(args.requests)]
    for method in args.methods:
        timed_pass(engine, prompts, method, args)  # untimed: compiles, first allocations
    for _ in range(args.rounds):
        for method in args.methods:
            tokens_per_s, digest = timed_pass(engine, prompts, method, args)
            print(f"{method} {tokens_per_s:.1f} tok/s ids {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
