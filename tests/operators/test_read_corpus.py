"""Reading a corpus to refine: every source kind gives one row per text, and bad texts are error rows."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from operators.read_corpus import corpus_items, parse_item


def rows_of(source, **kwargs):
    return [row for item in corpus_items(str(source), kwargs.pop("glob", "*.txt"))
            for row in parse_item(item, **kwargs)]


def test_directory_texts_keyed_by_relative_path_with_bad_files_as_error_rows(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("first text")
    (tmp_path / "two.txt").write_bytes(b"caf\xff")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "skip.md").write_text("not matched")
    rows = {r["key"]: r for r in rows_of(tmp_path)}
    assert set(rows) == {"a/one.txt", "two.txt", "empty.txt"}
    assert rows["a/one.txt"]["text"] == "first text" and rows["a/one.txt"]["error"] is None
    assert "UTF-8" in rows["two.txt"]["error"] and rows["two.txt"]["text"] is None
    assert rows["empty.txt"]["error"] == "empty text"


def test_jsonl_and_parquet_rows_keep_their_ids_and_flag_missing_fields(tmp_path):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join([json.dumps({"id": 7, "body": "x y"}), json.dumps({"id": 8}), "[1]"]) + "\n")
    rows = rows_of(jsonl, text_field="body")
    assert [(r["key"], r["id"], r["error"] is None) for r in rows] == [
        ("c.jsonl:1", "7", True), ("c.jsonl:2", "8", False), ("c.jsonl:3", "c.jsonl:3", False)]
    assert "'body'" in rows[1]["error"] and "JSON" in rows[2]["error"]

    pq.write_table(pa.table({"id": ["p", "q"], "text": ["alpha beta", None]}), tmp_path / "t.parquet")
    rows = rows_of(tmp_path / "t.parquet")
    assert [(r["key"], r["id"], r["text"], r["error"]) for r in rows] == [
        ("t.parquet:0", "p", "alpha beta", None), ("t.parquet:1", "q", None, "no text")]


def test_shipped_corpora_are_found():
    items = corpus_items("corpus:aclsum")
    rows = parse_item(items[0])
    assert len(items) > 100 and len(rows) > 5 and all(r["key"].startswith("aclsum:") for r in rows)
    assert len(corpus_items("corpus:stdlib")) > 300
    answers = parse_item(corpus_items("corpus:mtbench-answers")[0])
    assert len(answers) > 30 and sum(r["error"] is None for r in answers) > 30
