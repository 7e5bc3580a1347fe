"""The edit and QA jobs end to end on the real default model: diff and quality columns, error rows. (Bad options:
test_job_arguments.py.)"""

import json
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from tests.job_runs import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def run(job, *args):
    return run_job(job, *args)  # in-process, on the session's Ray cluster


def rows_of(out: Path) -> dict:
    table = pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table()
    return {(r["request_id"], r["method"]): r for r in table.to_pylist()}


def test_edit_job_stores_a_diff_per_row_and_scores_computable_edits(ray_cluster, tmp_path):
    sample = [json.loads(line) for line in (ROOT / "samples" / "edit_documents.jsonl").read_text().splitlines()]
    assert sample[0]["max_new_tokens"] > 24
    rows = [sample[0], {"id": "empty-document", "document": "  ", "instruction": "Edit."},
            {"id": "run-instruction", "document": "Alpha beta gamma.\n", "max_new_tokens": 8}]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run("edit_documents.py", "--input", str(source), "--output", str(tmp_path / "out"), "--method", "ar",
               "--method", "copyspec", "--max-new-tokens", "24", "--dtype", "float32",
               "--instruction", "Write it in upper case.")
    # 2 error rows of 6 are over the default --max-error-fraction 0.05: everything written, then exit status 3
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "the most common:" in proc.stderr and "empty document" in proc.stderr
    out = rows_of(tmp_path / "out")
    assert len(out) == 6
    assert "empty document" in out[("empty-document", "ar")]["error"]
    # The row asks for more than --max-new-tokens 24: the job's cap wins (it used to decode the row's own 96+).
    assert out[("edit-rename", "ar")]["new_tokens"] == 24
    # The row without an instruction of its own takes --instruction (without it, it would be an error row).
    assert out[("run-instruction", "copyspec")]["error"] is None
    assert out[("run-instruction", "copyspec")]["new_tokens"] == 8
    edited = out[("edit-rename", "copyspec")]
    assert edited["error"] is None and edited["task"] == "code_edit"
    assert edited["quality_metric"] == "exact_match" and edited["quality"] in (0.0, 1.0)
    assert edited["diff"].startswith("--- input\n+++ output\n")
    # Lossless: the same output, hence the same diff, for ar and copyspec.
    assert edited["output_token_ids"] == out[("edit-rename", "ar")]["output_token_ids"]
    assert edited["diff"] == out[("edit-rename", "ar")]["diff"]


def test_answer_job_scores_answers_by_token_f1_with_a_compressed_context(ray_cluster, tmp_path):
    """--compress-context 2: the prompt carries about half the context's tokens (the question whole), the job scores
    as usual."""
    from transformers import AutoTokenizer

    from operators.task_prompts import compose_prompt
    from specdec_core.model.model_registry import resolve_model_path
    from specdec_core.prompts import build_prompt_ids

    proc = run("answer_questions.py", "--output", str(tmp_path / "qa"), "--method", "ar", "--method", "pld",
               "--limit", "1", "--max-new-tokens", "16", "--dtype", "float32", "--compress-context", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = rows_of(tmp_path / "qa")
    assert set(out) == {("qa-bridge-year", "ar"), ("qa-bridge-year", "pld")}
    answer = out[("qa-bridge-year", "pld")]
    assert answer["error"] is None and answer["task"] == "qa" and answer["quality_metric"] == "token_f1"
    assert 0.0 <= answer["quality"] <= 1.0 and answer["diff"] is None
    row = json.loads((ROOT / "samples" / "questions.jsonl").read_text().splitlines()[0])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    whole = len(build_prompt_ids(tokenizer, prompt=compose_prompt(row)))
    context = len(tokenizer(row["context"][:6000], add_special_tokens=False)["input_ids"])
    assert abs((whole - answer["prompt_tokens"]) - context / 2) <= 0.15 * context, (whole, answer["prompt_tokens"])
