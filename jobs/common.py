"""The option set every generation job shares, and the thin main that runs one: parse, check, run, summarize.

Everything that can be checked without Ray (methods, model names, input path, drafter) fails fast with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from operators.read_requests import check_input_path
from pipelines.config import GenerationConfig
from pipelines.generate import RunExistsError, init_ray, run_generation
from pipelines.outputs import (
    RunLockedError,
    common_errors,
    latest_unfinished_run,
    kernel_plans,
    method_stats,
    method_summary,
    run_dir,
)
from specdec_core.cli import OneLineParser, add_batch_options, add_deterministic_option, shared_method_options
from specdec_core.drafters.retrieval_index import check_index_tokenizer, load_index
from specdec_core.defaults import DRAFTER_DTYPE_CHOICES, DTYPE_CHOICES
from specdec_core.errors import SpecbatchError
from specdec_core.methods import METHODS, MethodOptions, get_method
from specdec_core.model.model_registry import check_model_available, resolve_model_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


EXIT_BAD_ARGUMENTS = 2
EXIT_TOO_MANY_ERRORS = 3  # everything was written, but more rows failed than --max-error-fraction allows


def build_parser(prog: str, description: str, default_input: str | None, default_methods: list[str],
                 default_max_new_tokens: int | None = None):
    """Every job's options, in three groups of --help: what to read and write, how to decode, how to run."""
    parser = OneLineParser(prog=prog, description=description,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _input_output_options(parser.add_argument_group("input and output"), default_input)
    _decoding_options(parser.add_argument_group("model and decoding"), default_methods, default_max_new_tokens)
    _running_options(parser.add_argument_group("actors, limits and errors"))
    return parser


def _default(name: str):
    """The run config's own default: argparse shows it, and never keeps a second copy."""
    return GenerationConfig.model_fields[name].default


def _input_output_options(group, default_input: str | None) -> None:
    group.add_argument("--input", default=default_input, required=default_input is None,
                       help="a JSONL or Parquet file; a directory (its *.jsonl, *.json and *.parquet files; other "
                            "files are skipped); hf:DIR (datasets.save_to_disk) or workload:NAME (sample, "
                            "summarization, rag, code_edit, humaneval, multi_turn, open_questions)")
    group.add_argument("--recursive", action="store_true", help="read a directory input's subfolders too")
    group.add_argument("--output", default="outputs", help="output directory (generations/ and runs/ below it)")
    group.add_argument("--limit", type=int, default=None, help="decode only the first N requests")
    group.add_argument("--resume", action="store_true",
                       help="continue an interrupted run: --run-id's, or the latest run in --output without "
                            "_SUCCESS; pairs it already wrote with the same model, dtype, sampling and decoding "
                            "options are skipped")
    group.add_argument("--run-id", default=None, help="letters, digits, '.', '_', '-' (default: time + random)")


def _decoding_options(group, default_methods: list[str], default_max_new_tokens: int | None) -> None:
    group.add_argument("--method", action="append", dest="methods",
                       help=f"repeatable; one of {', '.join(METHODS)} (default: {' '.join(default_methods)})")
    group.add_argument("--model", default=_default("model"), help="registry name, local HF directory or hub id")
    group.add_argument("--drafter", default=None, help="draft model for draft / copyspec+draft")
    group.add_argument("--drafter-dtype", default=None, choices=DRAFTER_DTYPE_CHOICES,
                       help="the draft model's dtype (default: int8 for a bf16 target on a CPU, else the target's); "
                            "int8 (CPU only) quantizes its linear layers, which makes a small drafter's tokens "
                            "cheaper and changes only what it proposes")
    group.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens or _default("max_new_tokens"),
                       help="most new tokens per request (a row's own max_new_tokens is capped by it)")
    group.add_argument("--temperature", type=float, default=_default("temperature"), help="0: greedy")
    group.add_argument("--top-p", type=float, default=_default("top_p"), help="nucleus sampling's probability mass")
    group.add_argument("--top-k", type=int, default=_default("top_k"), help="sample among the k likeliest (0: all)")
    group.add_argument("--seed", type=int, default=None, help="a sampling run's seed: the same tokens run after run")
    group.add_argument("--dtype", default=_default("dtype"), choices=DTYPE_CHOICES)
    group.add_argument("--device", default=_default("device"))
    add_deterministic_option(group)
    add_batch_options(group, _default("batch_size"), "sequences decoded at once per actor (continuous batching)")
    group.add_argument("--memory-tokens", type=int, default=_default("memory_tokens"),
                       help="suffix/auto: output tokens each decode actor remembers per method to draft from "
                            "(~2 KB each), oldest evicted first; 0 = no job memory")
    group.add_argument("--memory-from", default=None, metavar="OUTPUT",
                       help="suffix/auto: seed the job memory with earlier runs' outputs in this output directory "
                            "(e.g. last night's --output; same tokenizer); it changes speed, never outputs")


def _running_options(group) -> None:
    group.add_argument("--num-actors", type=int, default=_default("num_actors"),
                       help="decode actors (each loads the model once)")
    group.add_argument("--cpus-per-actor", type=float, default=None)
    group.add_argument("--num-gpus-per-actor", type=float, default=_default("num_gpus_per_actor"))
    group.add_argument("--rows-per-call", type=int, default=None,
                       help="rows handed to a decode actor per call, also the rows a crash can lose (default: 4 x "
                            "--batch-size, at least 32)")
    group.add_argument("--row-timeout-s", type=float, default=None,
                       help="a row decoding longer than this gets an error row and frees its slot (default: none)")
    group.add_argument("--hang-timeout-s", type=float, default=None,
                       help="a decode actor whose forward has made no progress for this long ends its process and "
                            "the job goes on without it (its rows are retried; a row that hangs every time gets an "
                            "error row); default: 20x the slowest forward seen, at least 300 s")
    group.add_argument("--max-prompt-tokens", type=int, default=None,
                       help="a longer prompt is an error row (default: the model's context)")
    group.add_argument("--max-context-tokens", type=int, default=_default("max_context_tokens"),
                       help="a longer `context` (the copy drafters' extra source) is an error row")
    group.add_argument("--max-error-fraction", type=float, default=_default("max_error_fraction"),
                       help=f"past this share of error rows the job exits with status {EXIT_TOO_MANY_ERRORS}, "
                            "after writing every row")
    group.add_argument("--address", default=None, help="Ray cluster address (default: embedded local Ray)")


def config_from_args(args, job: str, default_methods: list[str], task_template: str | None = None,
                     default_task: str | None = None):

    values = dict(
        input=args.input, output=args.output, recursive=args.recursive, job=job, methods=args.methods or default_methods, model=args.model,
        drafter=args.drafter, drafter_dtype=args.drafter_dtype, dtype=args.dtype, device=args.device,
        deterministic=args.deterministic,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, method_options=MethodOptions(**{
            **shared_method_options(args),
            # Actors may not share the driver's working directory: the index by its absolute path.
            "retrieval_index": os.path.abspath(args.retrieval_index) if args.retrieval_index else None}),
        task_template=task_template, batch_size=args.batch_size, token_budget=args.token_budget,
        speculation_budget=args.speculation_budget,
        default_task=default_task,
        num_actors=args.num_actors, cpus_per_actor=args.cpus_per_actor, num_gpus_per_actor=args.num_gpus_per_actor,
        limit=args.limit, resume=args.resume, rows_per_call=args.rows_per_call, row_timeout_s=args.row_timeout_s,
        hang_timeout_s=args.hang_timeout_s,
        max_prompt_tokens=args.max_prompt_tokens, max_context_tokens=args.max_context_tokens,
        max_error_fraction=args.max_error_fraction, memory_tokens=args.memory_tokens,
        # Actors may not share the driver's working directory: the outputs by their absolute path.
        memory_from=os.path.abspath(args.memory_from) if args.memory_from else None,
    )
    for job_option in ("instruction", "max_context_chars", "compress_context", "compression_model"):  # some jobs
        if getattr(args, job_option, None) is not None:
            values[job_option] = getattr(args, job_option)
    if args.run_id:
        values["run_id"] = args.run_id
    elif args.resume:

        values["run_id"] = latest_unfinished_run(args.output)
        if values["run_id"] is None:
            raise SpecbatchError(f"--resume: no unfinished run in {args.output} (name one with --run-id)")
    return GenerationConfig(**values)


def preflight(config) -> None:

    described = check_input_path(config.input, config.recursive)
    if run_dir(config.output, config.run_id).exists() and not config.resume:
        raise SpecbatchError(f"run id {config.run_id!r} already has output in {config.output}: pass --resume to "
                             "continue it, or choose another --run-id")
    check_model_available(config.model)
    if config.drafter:
        check_model_available(config.drafter)
        check_drafter_vocabulary(config)
    if config.compression_model:
        check_model_available(config.compression_model)

    for method in config.methods:  # a method missing what it needs (an index) fails here, not on every row
        spec = get_method(method)
        if not spec.needs_draft_model:
            spec.build_drafter(config.method_options, None)
    if config.memory_from and any(get_method(m).uses_job_memory for m in config.methods):
        check_memory_from(config)
    if config.method_options.retrieval_index:  # before Ray starts: a missing or foreign index is one line
        from transformers import AutoTokenizer


        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
        check_index_tokenizer(config.method_options.retrieval_index, tokenizer, config.model)

        try:
            load_index(config.method_options.retrieval_index)
        except (OSError, ValueError) as exc:  # a missing or corrupt array file
            raise SpecbatchError(f"retrieval index {config.method_options.retrieval_index} cannot be read: "
                                 f"{exc}") from None
    check_output_path(config.output, config.input)  # last: it makes the output directory
    if described:
        print(described, file=sys.stderr)


def check_output_path(output: str, source: str) -> None:
    """An output that is a file, cannot be written, or lies inside the input: one line, before Ray starts. The
    directory is made (as the job would) and a probe file written and removed in it: the only sure test of write
    access, whoever runs the job."""
    path = Path(output).resolve()
    if path.exists() and not path.is_dir():
        raise SpecbatchError(f"output {output} is a file, not a directory")
    if not source.startswith(("workload:", "hf:")):
        data = Path(source).resolve()
        if data.is_dir() and (path == data or data in path.parents):
            raise SpecbatchError(f"output {output} is inside the input directory {source}: a later run would read "
                                 "its outputs as input")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise SpecbatchError(f"output {output} cannot be written: {exc.strerror or exc}") from None


def check_memory_from(config) -> None:
    """--memory-from that is not a job's output, or holds another tokenizer's outputs: one line, before Ray."""
    from transformers import AutoTokenizer

    from specdec_core.drafters.job_memory import read_outputs  # lazy: numba (the suffix tree), only with --memory-from

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
    own_output = os.path.abspath(config.output) == config.memory_from  # a nightly job's first night: nothing yet
    read_outputs(config.memory_from, tokenizer, config.model, config.memory_tokens, missing_ok=own_output)


def check_drafter_vocabulary(config) -> None:
    """`draft` / `copyspec+draft` with a drafter of another tokenizer would fail every row: one line instead."""
    same_vocabulary_methods = [m for m in config.methods if m in ("draft", "copyspec+draft")]
    if not same_vocabulary_methods:
        return
    from transformers import AutoTokenizer


    target = AutoTokenizer.from_pretrained(resolve_model_path(config.model))
    drafter = AutoTokenizer.from_pretrained(resolve_model_path(config.drafter))
    if target.get_vocab() != drafter.get_vocab():
        raise SpecbatchError(f"--drafter {config.drafter} has a different tokenizer from --model {config.model}: "
                             f"{' and '.join(same_vocabulary_methods)} verify the drafter's token ids as the "
                             "target's; use --method slem, tli, union or slrs, which draft across vocabularies")


def main_for(job: str, description: str, default_input: str | None, default_methods: list[str],
             task_template: str | None = None, default_task: str | None = None, default_max_new_tokens: int | None = None,
             add_options=None, argv: list[str] | None = None) -> int:
    """Parse, check (one line and exit 2 on bad input, before Ray starts), run, summarize. add_options(parser)
    adds a job's own options."""
    from pydantic import ValidationError


    parser = build_parser(f"{job}.py", description, default_input, default_methods, default_max_new_tokens)
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, job, default_methods, task_template, default_task)
        preflight(config)
    except (ValidationError, SpecbatchError) as exc:
        return report_validation_error(job, exc)

    init_ray(args.address, output=config.output)
    try:
        summary = run_generation(config)
    except (RunExistsError, RunLockedError) as exc:
        return report_validation_error(job, exc)
    print_method_summary(config.output, config.run_id, summary.get("warmup_s"))
    print(json.dumps({k: summary[k] for k in ("run_id", "rows_in", "rows_out", "errors", "skipped_pairs")}
                     | {"wall_s": round(summary["wall_s"], 1), "output": config.output}))
    return error_exit_status(job, config, summary)


def error_exit_status(job: str, config, summary: dict) -> int:
    """Names the most common errors; EXIT_TOO_MANY_ERRORS when their share is over --max-error-fraction, else 0."""

    rows, errors = summary["rows_out"], summary["errors"]
    if summary.get("stopped_early"):
        early, early_errors = summary["stopped_early"]
        [(message, count)] = common_errors(config.output, config.run_id, top=1) or [("(none)", 0)]
        print(f"{job}.py: error: stopped early: {early_errors} of the first {early} rows were errors "
              f"({early_errors / max(early, 1):.0%}, over --max-error-fraction {config.max_error_fraction:g}); the "
              f"most common ({count}x): {message}. {rows} rows written; fix the cause, then --resume --run-id "
              f"{config.run_id} goes on (exit status {EXIT_TOO_MANY_ERRORS})", file=sys.stderr)
        return EXIT_TOO_MANY_ERRORS
    if not errors:
        return 0
    print(f"{errors} of {rows} output rows are errors; the most common:", file=sys.stderr)
    for message, count in common_errors(config.output, config.run_id):
        print(f"  {count:6d} x {message}", file=sys.stderr)
    if errors / max(rows, 1) > config.max_error_fraction:
        print(f"{job}.py: error: {errors / max(rows, 1):.1%} of the output rows are errors, over "
              f"--max-error-fraction {config.max_error_fraction:g} (exit status {EXIT_TOO_MANY_ERRORS})",
              file=sys.stderr)
        return EXIT_TOO_MANY_ERRORS
    return 0


def report_validation_error(job: str, exc: Exception) -> int:
    """One `JOB.py: error: ...` line on stderr for a bad configuration; returns the exit status (2)."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = f"{where + ': ' if where else ''}{first['msg']}"
    else:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    print(f"{job}.py: error: {message}", file=sys.stderr)
    return EXIT_BAD_ARGUMENTS


def print_method_summary(output: str, run_id: str, warmup_s: float | None = None) -> None:
    """Per method: job tokens/s over its timed passes and x ar, then the same split into prefill and decode."""

    accepted = {m["method"]: m["mean_accepted_length"] for m in method_summary(output, run_id)}
    stats = method_stats(output, run_id)
    ar = next((m for m in stats if m["method"] == "ar"), None)

    def ratio(m, key):
        return f"{m[key] / ar[key]:.2f}" if ar and m[key] and ar[key] else "-"

    def number(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    plans = kernel_plans(output, run_id)
    timed = f" (timed at load in {plans['kernel_plan_s']:.1f} s)" if plans["kernel_plan_s"] else ""
    for plan in plans["kernel_plans"]:
        print(f"linear kernel {plan}{timed}", file=sys.stderr)
    if warmup_s is not None:
        print(f"warm-up before timing (kernels, first forwards): {warmup_s:.1f} s", file=sys.stderr)
    captured = {m["method"]: m["capture_s"] for m in stats if m.get("capture_s")}
    if captured:  # a GPU's CUDA graphs of the decode and verify steps: in the wall time, not in decode tok/s
        print("capturing graph-ready steps took (of the wall time): " + ", ".join(
            f"{method} {seconds:.1f} s" for method, seconds in captured.items()), file=sys.stderr)
    for m in stats:
        print(f"{m['method']:12s} rows {m['requests']:4d}  errors {m['errors']:3d}  tokens {m['new_tokens']:6d}  "
              f"tok/s {number(m['job_tokens_per_s']):>6s} ({ratio(m, 'job_tokens_per_s')}x ar)  "
              f"prefill {number(m['prefill_s'])} s  decode tok/s {number(m['decode_tokens_per_s']):>6s} "
              f"({ratio(m, 'decode_tokens_per_s')}x ar)  accepted length {number(accepted.get(m['method']), 2)}",
              file=sys.stderr)