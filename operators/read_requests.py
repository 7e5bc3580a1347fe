"""Read the workload input contract into a Ray Dataset of normalized requests.

JSONL is read as bytes and parsed line by line, so one bad line (invalid JSON or UTF-8) becomes one error row
instead of failing the whole file, as a pyarrow JSON reader would.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from corpora import aclsum, code_edit, mtbench, sample
from specdec_core.errors import SpecbatchError

from .requests_schema import normalize_row, requests_table

WORKLOADS = ("sample", "summarization", "rag", "code_edit", "humaneval", "multi_turn", "open_questions")


def workload_rows(name: str, limit: int | None) -> list[dict]:
    loaders = {
        "sample": lambda: sample.sample_rows(),
        "summarization": lambda: aclsum.summarization_rows(limit),
        "rag": lambda: aclsum.rag_rows(limit),
        "code_edit": lambda: code_edit.stdlib_rename_tasks(limit or 10),
        "humaneval": lambda: code_edit.humaneval_rows(limit),
        "multi_turn": lambda: mtbench.mtbench_rows(limit),
        "open_questions": lambda: mtbench.open_question_rows(limit),
    }
    if name not in loaders:
        raise SpecbatchError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    return loaders[name]()


DATA_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}  # what a directory input is read for


def input_files(source: str, recursive: bool = False) -> tuple[list[dict], int]:
    """An input path's data files, as [{"path", "kind", "root"}] in order, and how many other files were skipped.
    A file named directly is read whatever its name (JSONL unless it ends in .parquet). In a directory only
    *.jsonl, *.json and *.parquet are read: its own files, the Hive partition folders of a Parquet dataset
    (`task=qa/`), and other folders only with `recursive`."""
    path = Path(source)
    if path.is_file():
        return [{"path": str(path), "kind": DATA_KINDS.get(path.suffix, "jsonl"), "root": None}], 0
    files, skipped = [], 0
    pending = [path]
    while pending:
        folder = pending.pop()
        for entry in sorted(folder.iterdir()):
            if entry.is_dir():
                if recursive or "=" in entry.name:
                    pending.append(entry)
            elif entry.suffix in DATA_KINDS and entry.is_file():
                files.append({"path": str(entry), "kind": DATA_KINDS[entry.suffix], "root": str(path)})
            else:
                skipped += 1
    return sorted(files, key=lambda f: f["path"]), skipped


def parse_input_file(item: dict) -> list[dict]:
    """flat_map UDF: one data file (input_files) -> its raw rows."""
    if item["kind"] == "parquet":
        return parse_parquet_file(item)
    path = item["path"]
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return [_raw({"id": Path(path).name, "input_error": f"file {Path(path).name} cannot be read: {exc}"}, path)]
    return parse_jsonl_file({"bytes": data, "path": path})


def _binary(data: bytes) -> bool:
    """A file that is not text: a NUL byte near its start, or most of its lines not UTF-8."""
    if b"\0" in data[:8192]:
        return True
    lines = [line for line in data.splitlines()[:200] if line.strip()]
    bad = 0
    for line in lines:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            bad += 1
    return bool(lines) and bad > max(1, len(lines) // 2)


def parse_jsonl_file(item: dict) -> list[dict]:
    """flat_map UDF: one JSONL file's bytes -> one raw row per non-empty line (bad lines carry input_error); a file
    that holds a JSON array (a .json file) -> one row per element; a binary file -> one error row for the file."""
    path = item.get("path", "input")
    name = Path(path).name
    data = item["bytes"]
    if _binary(data):
        return [_raw({"id": name, "input_error": f"file {name} is not UTF-8 text (a binary file?)"}, path)]
    if data.lstrip()[:1] == b"[":
        return _json_array(data, path)
    rows = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.decode("utf-8"))
            if not isinstance(value, dict):
                raise ValueError("a JSON object per line is expected")
        except UnicodeDecodeError:
            value = {"id": f"{Path(path).name}:{number}", "input_error": f"line {number} is not valid UTF-8"}
        except ValueError as exc:
            value = {"id": f"{Path(path).name}:{number}", "input_error": f"line {number} is not valid JSON: {exc}"}
        rows.append({"raw": json.dumps(value, default=str), "position": f"{path}:{number}"})
    return rows


def _json_array(data: bytes, path: str) -> list[dict]:
    """A file holding one JSON array of objects -> a raw row per element (a non-object element is an error row)."""
    name = Path(path).name
    try:
        values = json.loads(data.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        return [_raw({"id": name, "input_error": f"file {name} is not valid JSON: {_first_line(exc)}"}, path)]
    return [_raw(value if isinstance(value, dict) else {
        "id": f"{name}:{index}", "input_error": f"element {index} of {name} is not a JSON object"}, f"{path}:{index}")
        for index, value in enumerate(values, start=1)]


def parse_parquet_file(item: dict) -> list[dict]:
    """flat_map UDF: one Parquet file -> one raw row per record, read row group by row group, so a corrupt file or
    row group becomes one error row (naming it) instead of failing the job, as ray.data.read_parquet would."""
    import pyarrow.parquet as pq

    path = item["path"]
    name = Path(path).name
    # Hive-style directories (task=qa/part-0.parquet) give their rows that column, as pyarrow's reader does.
    folders = Path(path).relative_to(item["root"]).parent.parts if item.get("root") else ()
    partition = dict(part.split("=", 1) for part in folders if "=" in part)
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:
        return [_raw({"id": name, "input_error": f"Parquet file {name} cannot be read: {_first_line(exc)}"}, path)]
    rows = []
    for group in range(parquet.num_row_groups):
        try:
            records = parquet.read_row_group(group).to_pylist()
        except Exception as exc:
            rows.append(_raw({"id": f"{name}:row-group-{group}", "input_error": (
                f"row group {group} of Parquet file {name} cannot be read: {_first_line(exc)}")}, f"{path}:{group}"))
            continue
        rows.extend(_raw(_text_from_bytes({**partition, **record}), f"{path}:{group}:{index}")
                    for index, record in enumerate(records))
    return rows


def _text_from_bytes(record: dict) -> dict:
    """Binary columns -> text, so the record survives JSON; invalid UTF-8 becomes the row's input_error."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                out["input_error"] = f"column {key!r} is not valid UTF-8"
                value = None
        out[key] = value
    return out


def _raw(record: dict, position: str) -> dict:
    return {"raw": json.dumps(record, default=str), "position": position}


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:300]


HF_POSITION = "__specbatch_position"  # a column added to a `hf:` dataset's rows: their index


def normalize_batch(batch) -> "object":
    """map_batches UDF (pandas in, Arrow out): raw rows -> the requests schema, each with its input position."""
    records = batch.to_dict("records")
    if "raw" in batch.columns:
        positions = [r.get("position") for r in records]
        records = [json.loads(r["raw"]) for r in records]
    else:
        positions = [r.pop(HF_POSITION, None) for r in records]
    rows = [normalize_row(_drop_nans(r)) for r in records]
    for row, position in zip(rows, positions):
        row["position"] = position if isinstance(position, str) else None
    return requests_table(rows)


def _drop_nans(record: dict) -> dict:
    return {k: v for k, v in record.items() if not (isinstance(v, float) and v != v)}


def check_input_path(source: str, recursive: bool = False) -> str | None:
    """Fail fast, before Ray starts, on an input that cannot be read at all or a directory without data files;
    -> for a directory, one line saying what it holds."""
    if source.startswith("workload:"):
        if source.split(":", 1)[1] not in WORKLOADS:
            raise SpecbatchError(f"unknown workload {source.split(':', 1)[1]!r}; choose one of: {', '.join(WORKLOADS)}")
        return None
    path = Path(source.removeprefix("hf:"))
    if not path.exists():
        raise SpecbatchError(f"input not found: {path}")
    if source.startswith("hf:") or path.is_file():
        return None
    try:
        files, skipped = input_files(source, recursive)
    except OSError as exc:
        raise SpecbatchError(f"input directory {path} cannot be listed: {exc}") from None
    kinds = Counter(Path(f["path"]).suffix for f in files)
    read = ", ".join(f"{count} {suffix}" for suffix, count in sorted(kinds.items()))
    where = "" if recursive else " (subfolders are read with --recursive)"
    if not files:
        raise SpecbatchError(f"input directory {path} holds no data file (*.jsonl, *.json, *.parquet){where}: "
                             f"{skipped} other files")
    return f"input {path}: {len(files)} data files ({read}); {skipped} other files skipped"


def read_requests(source: str, limit: int | None = None, task_cpus: float = 0.25, rows_per_block: int | None = None,
                  recursive: bool = False):
    """-> ray.data.Dataset in the requests schema (prompt ids not yet filled), in blocks of at most
    `rows_per_block` rows when given (the pipeline passes its rows per decode call: see generate.py).

    Every task here asks for task_cpus (a fraction): with decode actors holding most CPUs of a small machine, a
    task that wants a whole CPU would wait forever.
    """
    import ray.data


    check_input_path(source, recursive)
    if source.startswith("workload:"):
        name = source.split(":", 1)[1]
        rows = [_raw(r, f"workload:{name}:{i}") for i, r in enumerate(workload_rows(name, limit))]
        dataset = ray.data.from_items(rows)
    elif source.startswith("hf:"):
        import datasets

        rows = datasets.load_from_disk(source[3:])
        dataset = ray.data.from_huggingface(rows.add_column(HF_POSITION, [f"hf:{i}" for i in range(len(rows))]))
    else:
        files, _ = input_files(source, recursive)
        dataset = ray.data.from_items(files, override_num_blocks=max(1, min(len(files), 64)))
        dataset = dataset.flat_map(parse_input_file, num_cpus=task_cpus)
    if limit is not None:
        dataset = dataset.limit(limit)
    normalized = dataset.map_batches(normalize_batch, batch_format="pandas", batch_size=256, num_cpus=task_cpus)
    if rows_per_block is None:
        return normalized
    # Streaming repartition (no barrier). Its tasks would ask for a whole CPU, which a 2-CPU cluster whose decode
    # actor holds 1.5 never frees (the job hangs), and `repartition` takes no resource arguments, so the
    # logical operator gets the light stages' fraction of a CPU.
    blocks = normalized.repartition(target_num_rows_per_block=rows_per_block)
    remote_args = getattr(getattr(getattr(blocks, "_logical_plan", None), "dag", None), "ray_remote_args", None)
    if not isinstance(remote_args, dict):  # another Ray than the pinned one: keep input blocks whole, never hang
        return normalized
    remote_args["num_cpus"] = task_cpus
    return blocks
