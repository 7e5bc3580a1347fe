"""A wrong path costs a second: a directory input reads its data files only (a binary file is one error row), a
directory without data files or a bad output path is one line and status 2 before Ray starts, and a job whose
errors dominate from its start stops early, resumable, while one with a few errors spread through it finishes."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from operators.read_requests import input_files, parse_jsonl_file
from tests.job_runs import run_job


def one_line_error(proc, fragment: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("summarize.py: error:"), proc.stderr
    assert fragment in lines[0], lines[0]


def test_a_directory_without_data_files_is_one_line_before_ray(tmp_path):
    data = tmp_path / "etc"
    (data / "sub").mkdir(parents=True)
    (data / "passwd").write_text("root:x:0:0\n")
    (data / "logo.png").write_bytes(b"\x89PNG\0\0")
    (data / "sub" / "rows.jsonl").write_text('{"prompt": "hi"}\n')  # a subfolder: only with --recursive
    proc = run_job("summarize.py", "--input", str(data), "--output", str(tmp_path / "out"))
    one_line_error(proc, "holds no data file (*.jsonl, *.json, *.parquet) (subfolders are read with --recursive): "
                         "2 other files")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output, fragment", [
    ("file", "is a file, not a directory"),
    ("file/below", "cannot be written"),
    ("input/out", "is inside the input directory"),
    ("input", "is inside the input directory"),
])
def test_a_bad_output_path_is_one_line_before_ray(tmp_path, output, fragment):
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "rows.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "file").write_text("not a directory\n")
    proc = run_job("summarize.py", "--input", str(tmp_path / "input"), "--output", str(tmp_path / output))
    one_line_error(proc, fragment)
    assert sorted(p.name for p in (tmp_path / "input").iterdir()) == ["rows.jsonl"]


def test_a_directory_lists_its_data_files_its_hive_folders_and_others_only_when_recursive(tmp_path):
    (tmp_path / "task=qa").mkdir()
    (tmp_path / "deeper").mkdir()
    for name in ("a.jsonl", "b.json", "c.parquet", "task=qa/d.parquet", "deeper/e.jsonl", "notes.txt", "x.bin"):
        (tmp_path / name).write_bytes(b"")
    files, skipped = input_files(str(tmp_path))
    assert [(Path(f["path"]).relative_to(tmp_path).as_posix(), f["kind"]) for f in files] == [
        ("a.jsonl", "jsonl"), ("b.json", "json"), ("c.parquet", "parquet"), ("task=qa/d.parquet", "parquet")]
    assert skipped == 2
    files, _ = input_files(str(tmp_path), recursive=True)
    assert "deeper/e.jsonl" in [Path(f["path"]).relative_to(tmp_path).as_posix() for f in files]
    named, _ = input_files(str(tmp_path / "notes.txt"))  # a file named directly is read, as JSONL
    assert named == [{"path": str(tmp_path / "notes.txt"), "kind": "jsonl", "root": None}]


def test_a_binary_file_is_one_error_row_and_a_json_array_one_row_per_element():
    binary = parse_jsonl_file({"bytes": b"\x7fELF\0\0\x01" + bytes(range(256)) * 40, "path": "/x/tool.jsonl"})
    assert [json.loads(r["raw"]) for r in binary] == [
        {"id": "tool.jsonl", "input_error": "file tool.jsonl is not UTF-8 text (a binary file?)"}]
    one_bad_line = parse_jsonl_file({"bytes": b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n{"prompt": "b"}\n',
                                     "path": "/x/rows.jsonl"})
    assert [json.loads(r["raw"]).get("input_error") for r in one_bad_line] == [None, "line 2 is not valid UTF-8",
                                                                               None]
    array = parse_jsonl_file({"bytes": b'[{"prompt": "a"}, 7, {"prompt": "b"}]', "path": "/x/rows.json"})
    assert [json.loads(r["raw"]) for r in array] == [
        {"prompt": "a"}, {"id": "rows.json:2", "input_error": "element 2 of rows.json is not a JSON object"},
        {"prompt": "b"}]


def rows_of(out: Path) -> list[dict]:
    return pads.dataset(str(out / "generations"), format="parquet", partitioning="hive").to_table(
        columns=["request_id", "error", "new_tokens"]).to_pylist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_mixed_directory_decodes_every_good_row_once_and_each_bad_file_or_line_once(ray_cluster, tmp_path):
    data = tmp_path / "in"
    (data / "old").mkdir(parents=True)
    (data / "a.jsonl").write_text('{"id": "a1", "prompt": "Say one."}\n{"id": "a2", "prompt": \n')
    (data / "b.json").write_text(json.dumps([{"id": "b1", "prompt": "Say two."}, "not an object"]))
    pq.write_table(pa.table({"id": ["c1"], "prompt": ["Say three."]}), data / "c.parquet")
    (data / "d.jsonl").write_bytes(b"\0\0\0binary\xff\xfe" * 100)
    (data / "README.txt").write_text("not data\n")
    (data / "old" / "e.jsonl").write_text('{"id": "e1", "prompt": "Not read."}\n')
    out = tmp_path / "out"
    proc = run_job("summarize.py", "--input", str(data), "--output", str(out), "--method", "ar",
                   "--max-new-tokens", "2", "--dtype", "float32", "--max-error-fraction", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"input {data}: 4 data files (1 .json, 2 .jsonl, 1 .parquet); 1 other files skipped" in proc.stderr
    rows = rows_of(out)
    assert sorted(r["request_id"] for r in rows) == ["a.jsonl:2", "a1", "b.json:2", "b1", "c1", "d.jsonl"]
    assert {r["request_id"] for r in rows if r["error"] is None} == {"a1", "b1", "c1"}
    assert all(r["new_tokens"] > 0 for r in rows if r["error"] is None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_of_errors_stops_early_and_resumes_and_a_few_spread_errors_finish(ray_cluster, tmp_path):
    """1,000 empty prompts: the gate stops the job after its first few hundred rows (exit 3, one line naming the
    error, the run left unfinished); --resume goes on from there. 200 rows with 6 spread errors (3 %) finish every
    good row."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "  "}) + "\n" for i in range(1000)))
    out = tmp_path / "out"
    proc = run_job("summarize.py", "--input", str(bad), "--output", str(out), "--method", "ar", "--run-id", "night",
                   "--dtype", "float32")
    assert proc.returncode == 3, proc.stderr[-3000:]
    [line] = [l for l in proc.stderr.splitlines() if l.startswith("summarize.py: error:")]
    assert "stopped early" in line and "x): empty prompt: nothing to decode" in line and "--resume" in line, line
    written = len(rows_of(out))
    assert 100 <= written < 1000 and not (out / "generations" / "run_id=night" / "_SUCCESS").exists()
    proc = run_job("summarize.py", "--input", str(bad), "--output", str(out), "--method", "ar", "--run-id", "night",
                   "--dtype", "float32", "--resume", "--max-error-fraction", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(r["request_id"] for r in rows_of(out)) == sorted(f"r{i}" for i in range(1000))

    spread = tmp_path / "spread.jsonl"
    spread.write_text("".join(json.dumps({"id": f"s{i}", "prompt": "  " if i % 33 == 5 else f"Say {i}."}) + "\n"
                              for i in range(200)))
    proc = run_job("summarize.py", "--input", str(spread), "--output", str(tmp_path / "out2"), "--method", "ar",
                   "--max-new-tokens", "1", "--dtype", "float32", "--batch-size", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = rows_of(tmp_path / "out2")
    assert len(rows) == 200 and sum(r["error"] is not None for r in rows) == 6
