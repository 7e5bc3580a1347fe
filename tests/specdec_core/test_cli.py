"""The one-prompt CLI: bad input gives one clear line and exit 2, never a traceback; --json carries every metric.

Argument checks call the CLI's main in this process (no model is loaded before they fail); the tests that decode
load the real model, and one runs `python -m specdec_core` itself."""

import json
import subprocess
import sys

import pytest

from specdec_core.cli import main
from tests.job_runs import run_main

CONTRACT_KEYS = {
    "output_text", "output_token_ids", "method", "model", "drafter", "dtype", "device", "temperature", "seed",
    "prompt_tokens", "new_tokens", "finish_reason", "target_forwards", "drafted_tokens", "accepted_tokens",
    "mean_accepted_length", "acceptance_rate", "copied_tokens", "accepted_by_source", "ttft_s", "tpot_s", "wall_s",
    "tokens_per_s", "lossy",
}


def cli(*args):
    """The CLI's main in-process: (returncode, stdout, stderr) as a process would give them."""
    return run_main(main, *args)


def run_cli_process(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specdec_core", *args], capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("specbatch: error:") and fragment in lines[0], lines[0]


def test_unknown_method():
    assert_one_line_error(cli("--method", "nope", "--prompt", "hi"), "unknown method 'nope'")


def test_unknown_model():
    assert_one_line_error(cli("--model", "no-such-model", "--prompt", "hi"), "unknown model 'no-such-model'")


def test_empty_prompt():
    assert_one_line_error(cli("--prompt", "  "), "empty prompt")


def test_invalid_utf8_file(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 \xff")
    assert_one_line_error(cli("--prompt-file", str(bad)), "not valid UTF-8")


def test_bad_messages_file(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text('[{"role": "user"}]')
    assert_one_line_error(cli("--messages-file", str(path)), "content")


def test_bad_argument_value():
    assert_one_line_error(cli("--prompt", "hi", "--max-new-tokens", "many"), "--max-new-tokens")
    assert_one_line_error(cli("--prompt", "hi", "--temperature", "-1"), "temperature")


def test_draft_method_without_drafter():
    assert_one_line_error(cli("--method", "draft", "--prompt", "hi"), "--drafter")


@pytest.mark.slow
def test_prompt_longer_than_context():
    assert_one_line_error(cli("--raw", "--prompt", "word " * 9000), "context limit")


@pytest.mark.slow
def test_json_output_has_every_metric(tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "Repeat after me: one two three, one two three."}]))
    proc = run_cli_process("--messages-file", str(chat), "--method", "copyspec", "--max-new-tokens", "24", "--json",
                   "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert CONTRACT_KEYS <= set(result)
    assert result["new_tokens"] == len(result["output_token_ids"]) > 0
    assert result["dtype"] == "float32" and result["lossy"] is False


def test_help_explains_itself():
    proc = cli("--help")
    assert proc.returncode == 0 and "copyspec" in proc.stdout and "--drafter" in proc.stdout


@pytest.mark.slow
def test_batch_mode_prints_one_json_line_per_input_line_in_order(tmp_path):
    """--prompts-file: every line gets its line (bad ones an error), in input order, with the single-prompt
    fields; a batched row equals the same prompt decoded alone (fp32)."""
    chat = [{"role": "user", "content": "Repeat after me: one two three, one two three."}]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join([
        json.dumps({"id": "long", "prompt": "Write a haiku about rivers.", "max_new_tokens": 20}),
        "{not json",
        json.dumps({"id": "chat", "messages": chat}),
        json.dumps({"id": "nothing"}),
    ]) + "\n")
    common = ("--method", "copyspec", "--candidates", "2", "--max-new-tokens", "16", "--dtype", "float32", "--json")
    proc = cli("--prompts-file", str(path), "--batch-size", "2", *common)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [line["id"] for line in lines] == ["long", "line-2", "chat", "nothing"]
    assert CONTRACT_KEYS <= set(lines[0]) and lines[0]["new_tokens"] == 20 and lines[2]["new_tokens"] <= 16
    assert "not a JSON object" in lines[1]["error"] and "needs `prompt`" in lines[3]["error"]
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(chat))
    alone = json.loads(cli("--messages-file", str(chat_file), *common).stdout)
    assert alone["output_token_ids"] == lines[2]["output_token_ids"]


def test_batch_mode_bad_file_and_bad_batch_size(tmp_path):
    assert_one_line_error(cli("--prompts-file", str(tmp_path / "missing.jsonl")), "cannot read")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert_one_line_error(cli("--prompts-file", str(empty)), "no requests")
    assert_one_line_error(cli("--prompt", "hi", "--batch-size", "0"), "--batch-size")


def test_deterministic_is_auto_by_default_on_as_a_bare_flag_and_checked():
    from contract.decode_config import DecodeConfig
    from specdec_core.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["--prompt", "hi"]).deterministic == "auto"
    assert parse(["--prompt", "hi", "--deterministic"]).deterministic == "on"
    assert parse(["--prompt", "hi", "--deterministic", "off"]).deterministic == "off"
    assert_one_line_error(cli("--prompt", "hi", "--deterministic", "maybe"), "--deterministic")
    assert [DecodeConfig(deterministic=v).deterministic for v in (True, False, "auto")] == ["on", "off", "auto"]
