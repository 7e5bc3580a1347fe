"""Every job's bad arguments fail fast, before Ray starts or a model loads: one `JOB.py: error: ...` line on stderr,
exit status 2, nothing written. The jobs' mains run in this process; test_job_processes.py runs two of them as the
processes a user starts, to see that nothing else reaches stderr there."""

import pytest

from tests.job_runs import run_job


def run_main(job: str, *args: str):
    proc = run_job(job, *args)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--method", "nope"], "unknown method"),
    (["--model", "no-such-model"], "unknown model"),
    (["--input", "/no/such/file.jsonl"], "input not found"),
    (["--method", "draft"], "drafter"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--run-id", "../x"], "run id"),
    (["--run-id", "/tmp/abs"], "run id"),
    (["--resume"], "no unfinished run"),
])
def test_generation_job_bad_arguments_fail_fast_with_one_line(tmp_path, args, fragment):
    code, stderr = run_main("summarize.py", "--output", str(tmp_path), *args)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("summarize.py: error:") and fragment in lines[0], \
        stderr
    assert not (tmp_path / "generations").exists()


@pytest.mark.parametrize("job, args, fragment", [
    ("edit_documents.py", ["--instruction"], "expected one argument"),
    ("answer_questions.py", ["--max-context-chars", "0"], "max_context_chars"),
    ("answer_questions.py", ["--compress-context", "0.5"], "compress_context"),
    ("edit_documents.py", ["--input", "/no/such.jsonl"], "input not found"),
    ("summarize.py", ["--method", "draft", "--drafter", "gemma3-270m"], "use --method slem"),
])
def test_job_specific_bad_arguments_fail_fast(tmp_path, job, args, fragment):
    code, stderr = run_main(job, "--output", str(tmp_path), *args)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and fragment in stderr, stderr


def test_a_reused_run_id_is_refused_without_resume(tmp_path):
    from pipelines.outputs import run_dir

    run_dir(str(tmp_path), "run-a").mkdir(parents=True)
    code, stderr = run_main("summarize.py", "--output", str(tmp_path), "--run-id", "run-a")
    assert code == 2 and "already has output" in stderr and "--resume" in stderr, stderr


@pytest.mark.parametrize("args, fragment", [
    (["--input", "missing.jsonl"], "input not found"),
    (["--input", "corpus:nope"], "unknown corpus"),
    (["--input", "corpus:stdlib", "--keep", "0"], "keep"),
    (["--input", "corpus:stdlib", "--keep", "3", "--keep-fraction", "0.5"], "not allowed"),
    (["--input", "corpus:stdlib", "--keep-tokens", "0"], "keep_tokens"),
])
def test_refinement_bad_arguments_fail_fast_with_one_line(tmp_path, args, fragment):
    code, stderr = run_main("refine_corpus.py", "--output", str(tmp_path / "out"), *args)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and fragment in stderr, stderr
    assert not (tmp_path / "out").exists()


def test_memory_from_another_tokenizers_outputs_or_nowhere_is_refused_with_one_line(tmp_path):
    import pyarrow.parquet as pq

    from contract.schema import generations_table

    seed = tmp_path / "last_night" / "generations" / "run_id=r" / "method=ar"
    seed.mkdir(parents=True)
    table = generations_table([{"request_id": "a", "model": "gemma3-270m", "output_token_ids": [1, 2, 3]}])
    pq.write_table(table.drop(["run_id", "method"]), seed / "part-0.parquet")
    output = str(tmp_path / "out")
    code, stderr = run_main("summarize.py", "--output", output, "--method", "suffix", "--memory-from",
                            str(tmp_path / "last_night"))
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "whose tokenizer is not 'smollm2-135m'" in stderr, stderr  # (a missing one: test_job_memory.py)
    assert not (tmp_path / "out").exists()
