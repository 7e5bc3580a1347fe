"""Read a corpus to refine into a Ray Dataset of texts: one row per text, {key, id, source, text, error}.

Sources: a JSONL file (a text per line in --text-field), a Parquet file or directory (the --text-field column), a
directory of text files (--glob, recursively), `hf:DIR` (a `datasets` dataset saved with save_to_disk), or a shipped
corpus `corpus:NAME` (corpora/retrieval_corpora.py). The driver lists work items (files, row ranges); tasks parse
them. `key` names a text by its place in the source (file, line, row) and is unique, so --resume skips exactly the
texts already scored; `id` is the text's own id field where it has one, else the key. A text that is empty or cannot
be decoded is a row with `error` set, never a failed job.
"""

from __future__ import annotations

import json
from pathlib import Path

from corpora.retrieval_corpora import (
    aclsum_paper_files,
    aclsum_paper_texts,
    check_named_corpus,
    mtbench_answer_texts,
    stdlib_files,
)
from specdec_core.errors import SpecbatchError

HF_ROWS_PER_ITEM = 2000


def check_corpus_source(source: str) -> None:
    """Fail fast, before Ray starts, on a source that cannot be read at all."""
    if source.startswith("corpus:"):

        check_named_corpus(source.split(":", 1)[1])
        return
    path = Path(source.removeprefix("hf:"))
    if not path.exists():
        raise SpecbatchError(f"input not found: {path}")


def corpus_items(source: str, glob: str = "*.txt") -> list[dict]:
    """Work items for the read tasks: each names a file, or a range of rows of a `datasets` dataset."""
    check_corpus_source(source)
    if source.startswith("corpus:"):
        name = source.split(":", 1)[1]
        if name == "stdlib":

            root, files = stdlib_files()
            return [{"kind": "file", "path": str(f), "root": str(root)} for f in files]
        if name == "aclsum":

            return [{"kind": "aclsum", "path": str(f)} for f in aclsum_paper_files()]
        return [{"kind": "mtbench"}]
    if source.startswith("hf:"):
        import datasets

        rows = len(datasets.load_from_disk(source[3:]))
        return [{"kind": "hf", "path": source[3:], "start": s, "stop": min(rows, s + HF_ROWS_PER_ITEM)}
                for s in range(0, rows, HF_ROWS_PER_ITEM)]
    path = Path(source)
    if path.is_dir():
        parquet = sorted(p for p in path.rglob("*.parquet") if p.is_file())
        if parquet:
            return [{"kind": "parquet", "path": str(p), "root": str(path)} for p in parquet]
        files = sorted(p for p in path.rglob(glob) if p.is_file())
        if not files:
            raise SpecbatchError(f"no files matching {glob!r} under {path} (set --glob)")
        return [{"kind": "file", "path": str(f), "root": str(path)} for f in files]
    if path.suffix == ".parquet":
        return [{"kind": "parquet", "path": str(path), "root": None}]
    if path.suffix in (".jsonl", ".json"):
        return [{"kind": "jsonl", "path": str(path)}]
    return [{"kind": "file", "path": str(path), "root": str(path.parent)}]


def text_row(key: str, text, source: str, id_value=None) -> dict:
    """The row of one text; a missing, non-string or blank text is an error row."""
    if text is None:
        error = "no text"
    elif not isinstance(text, str):
        error, text = f"the text is a {type(text).__name__}, not a string", None
    elif not text.strip():
        error = "empty text"
    else:
        error = None
    return {"key": key, "id": key if id_value is None else str(id_value), "source": source,
            "text": text if error is None else None, "error": error}


def decode_utf8(data: bytes) -> tuple[str | None, str | None]:
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 (byte {exc.start})"


def parse_item(item: dict, text_field: str = "text", id_field: str = "id") -> list[dict]:
    """flat_map UDF: one work item -> its text rows. Nothing here raises for a bad text or a bad file."""
    kind = item["kind"]
    try:
        if kind == "file":
            return [_file_row(item)]
        if kind == "jsonl":
            return _jsonl_rows(item["path"], text_field, id_field)
        if kind == "parquet":
            return _parquet_rows(item, text_field, id_field)
        if kind == "hf":
            return _hf_rows(item, text_field, id_field)
        if kind == "aclsum":

            return [text_row(key, text, Path(item["path"]).name) for key, text in aclsum_paper_texts(item["path"])]
        if kind == "mtbench":

            return [text_row(key, text, "mt_bench/reference_answer") for key, text in mtbench_answer_texts()]
    except Exception as exc:  # an unreadable file: one error row naming it
        return [{"key": item.get("path", kind), "id": item.get("path", kind), "source": item.get("path", kind),
                 "text": None, "error": f"cannot read: {type(exc).__name__}: {_first_line(exc)}"}]
    raise ValueError(f"unknown corpus item kind {kind!r}")


def _file_row(item: dict) -> dict:
    path = Path(item["path"])
    key = str(path.relative_to(item["root"])) if item.get("root") else path.name
    text, error = decode_utf8(path.read_bytes())
    row = text_row(key, text, key)
    if error:
        row["error"] = error
    return row


def _jsonl_rows(path: str, text_field: str, id_field: str) -> list[dict]:
    name, rows = Path(path).name, []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        key = f"{name}:{number}"
        text, error = decode_utf8(line)
        if error is None:
            try:
                record = json.loads(text)
                if not isinstance(record, dict):
                    raise ValueError("a JSON object per line is expected")
            except ValueError as exc:
                error = f"line {number} is not valid JSON: {_first_line(exc)}"
        if error is not None:
            rows.append({"key": key, "id": key, "source": name, "text": None, "error": error})
            continue
        rows.append(text_row(key, record.get(text_field), name, record.get(id_field)))
        if text_field not in record:
            rows[-1]["error"] = f"no {text_field!r} field (set --text-field)"
    return rows


def _parquet_rows(item: dict, text_field: str, id_field: str) -> list[dict]:
    import pyarrow.parquet as pq

    path = Path(item["path"])
    name = str(path.relative_to(item["root"])) if item.get("root") else path.name
    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        return [{"key": name, "id": name, "source": name, "text": None,
                 "error": f"no {text_field!r} column (set --text-field)"}]
    columns = [text_field] + ([id_field] if id_field in parquet.schema_arrow.names else [])
    rows, number = [], 0
    for group in range(parquet.num_row_groups):
        try:
            table = parquet.read_row_group(group, columns=columns)
        except Exception as exc:
            rows.append({"key": f"{name}:row-group-{group}", "id": f"{name}:row-group-{group}", "source": name,
                         "text": None, "error": f"row group {group} cannot be read: {_first_line(exc)}"})
            number += parquet.metadata.row_group(group).num_rows
            continue
        ids = table.column(id_field).to_pylist() if id_field in columns else [None] * table.num_rows
        for text, id_value in zip(table.column(text_field).to_pylist(), ids):
            error = None
            if isinstance(text, bytes):
                text, error = decode_utf8(text)
            rows.append(text_row(f"{name}:{number}", text, name, id_value))
            if error:
                rows[-1]["error"] = error
            number += 1
    return rows


def _hf_rows(item: dict, text_field: str, id_field: str) -> list[dict]:
    import datasets

    dataset = datasets.load_from_disk(item["path"])
    if text_field not in dataset.column_names:
        return [{"key": f"row-{item['start']}", "id": f"row-{item['start']}", "source": item["path"],
                 "text": None, "error": f"no {text_field!r} column (set --text-field)"}]
    part = dataset[item["start"]:item["stop"]]
    ids = part.get(id_field, [None] * len(part[text_field]))
    return [text_row(f"row-{item['start'] + i}", text, Path(item["path"]).name, id_value)
            for i, (text, id_value) in enumerate(zip(part[text_field], ids))]


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


def drop_done(batch, done: frozenset[str]):
    """map_batches UDF (pandas): rows whose key was scored by the run being resumed are dropped."""
    return batch[~batch["key"].isin(done)] if done else batch


def read_corpus(source: str, text_field: str = "text", id_field: str = "id", glob: str = "*.txt",
                limit: int | None = None, done: frozenset[str] = frozenset(), task_cpus: float = 0.25):
    """-> ray.data.Dataset of text rows; `limit` takes the first texts in reading order (kept the same on --resume:
    order is preserved, and done texts are dropped after the limit)."""
    import ray.data

    items = corpus_items(source, glob)
    if limit is not None:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
    dataset = ray.data.from_items(items, override_num_blocks=max(1, min(len(items), 200)))
    dataset = dataset.flat_map(parse_item, fn_kwargs={"text_field": text_field, "id_field": id_field},
                               num_cpus=task_cpus)
    if limit is not None:
        dataset = dataset.limit(limit)
    if done:
        dataset = dataset.map_batches(drop_done, fn_kwargs={"done": done}, batch_format="pandas",
                                      num_cpus=task_cpus)
    return dataset
