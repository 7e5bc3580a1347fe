"""The run's output directory without Ray: atomic block files with stable names, stale temporaries cleaned, the run
lock, run-id checks, the resume key."""

import json
import os
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from pydantic import ValidationError

from contract.schema import generations_table
from pipelines.config import GenerationConfig
from pipelines.outputs import (
    RunLock, RunLockedError, clean_temporary_files, done_pairs, drop_duplicate_pairs, latest_unfinished_run,
    mark_finished, run_dir,
)
from pipelines.parquet_sink import RunPartitionSink


def rows(ids, method="ar", key="k1", error=None):
    return [{"run_id": "r1", "request_id": i, "method": method, "decode_key": key, "new_tokens": 3, "error": error}
            for i in ids]


def test_blocks_land_atomically_under_stable_names_and_a_redone_block_replaces_itself(tmp_path):
    sink = RunPartitionSink(str(run_dir(tmp_path, "r1")))
    block = generations_table(rows(["a", "b"]) + rows(["a"], method="pld"))
    assert sink.write([block], ctx=None) == 3
    assert sink.write([block], ctx=None) == 3  # a retried write task / a redone decode batch
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 2 and all(f.endswith(".parquet") for f in files)
    assert {f.split("/")[2] for f in files} == {"method=ar", "method=pld"}
    table = pads.dataset(str(tmp_path / "generations"), format="parquet", partitioning="hive").to_table()
    assert sorted(zip(table.column("request_id").to_pylist(), map(str, table.column("method").to_pylist()))) == [
        ("a", "ar"), ("a", "pld"), ("b", "ar")]


def test_a_pair_published_twice_keeps_one_row(tmp_path):
    """A killed run's worker published {b, c} after the resume had decoded b and c again in other blocks: each
    (request, method, decode key) keeps one row; other keys, other methods and untouched files stay as they were."""
    sink = RunPartitionSink(str(run_dir(tmp_path, "r1")))
    sink.write([generations_table(rows(["a", "b"]))], ctx=None)
    sink.write([generations_table(rows(["c"]) + rows(["b"], method="pld"))], ctx=None)
    sink.write([generations_table(rows(["b", "c"]))], ctx=None)  # the late block
    sink.write([generations_table(rows(["a"], key="old"))], ctx=None)  # another decode key: another decode
    assert drop_duplicate_pairs(tmp_path, "r1") == 2
    table = pads.dataset(str(tmp_path / "generations"), format="parquet", partitioning="hive").to_table()
    assert sorted(zip(table.column("request_id").to_pylist(), map(str, table.column("method").to_pylist()),
                      table.column("decode_key").to_pylist())) == [
        ("a", "ar", "k1"), ("a", "ar", "old"), ("b", "ar", "k1"), ("b", "pld", "k1"), ("c", "ar", "k1")]
    assert drop_duplicate_pairs(tmp_path, "r1") == 0


def test_half_written_temporaries_are_invisible_and_cleaned(tmp_path):
    sink = RunPartitionSink(str(run_dir(tmp_path, "r1")))
    sink.write([generations_table(rows(["a"]))], ctx=None)
    stale = run_dir(tmp_path, "r1") / "method=ar" / ".part-dead.parquet.tmp"
    stale.write_bytes(b"PAR1 half a file")
    table = pads.dataset(str(tmp_path / "generations"), format="parquet", partitioning="hive").to_table()
    assert table.num_rows == 1  # the reader skips the hidden temporary
    assert clean_temporary_files(tmp_path, "r1") == 1 and not stale.exists()


def test_done_pairs_need_the_same_decode_key_and_count_error_rows(tmp_path):
    sink = RunPartitionSink(str(run_dir(tmp_path, "r1")))
    sink.write([generations_table(rows(["a"]) + rows(["bad"], error="ValueError: x") + rows(["c"], key="old"))],
               ctx=None)
    assert done_pairs(tmp_path, "r1", {"ar": "k1"}) == {"a\tar", "bad\tar"}
    assert done_pairs(tmp_path, "r1", {"ar": "k2"}) == frozenset()  # e.g. another --max-new-tokens
    assert done_pairs(tmp_path, "other", {"ar": "k1"}) == frozenset()


def test_decode_key_changes_with_what_changes_outputs_only(tmp_path):
    base = dict(input="in.jsonl", output=str(tmp_path), methods=["ar", "pld"], run_id="r")
    keys = GenerationConfig(**base).key_by_method()
    assert keys["ar"] != keys["pld"]
    assert GenerationConfig(**base, batch_size=3, num_actors=2).key_by_method() == keys
    for change in ({"max_new_tokens": 7}, {"model": "gemma3-270m"}, {"temperature": 0.5}):
        assert GenerationConfig(**base, **change).key_by_method()["ar"] != keys["ar"], change
    assert GenerationConfig(**base, dtype="float32").key_by_method() != GenerationConfig(
        **base, dtype="bfloat16").key_by_method()
    assert GenerationConfig(**base, max_prompt_tokens=9, row_timeout_s=2).key_by_method() == keys


def test_dtype_auto_is_keyed_by_what_it_resolves_to_so_another_machine_redoes_the_rows(tmp_path, monkeypatch):
    import specdec_core.model.hardware as runner

    base = dict(input="in.jsonl", output=str(tmp_path), methods=["ar"], run_id="r")
    for has_bf16, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(runner, "cpu_supports_bf16", lambda: has_bf16)
        assert GenerationConfig(**base).key_by_method() == GenerationConfig(**base, dtype=dtype,
                                                                            device="cpu").key_by_method()


@pytest.mark.parametrize("run_id", ["../x", "/abs", "a/b", "..", ".", "", "x y", "a\\b"])
def test_unsafe_run_ids_are_refused(run_id, tmp_path):
    with pytest.raises(ValidationError, match="run id"):
        GenerationConfig(input="in.jsonl", output=str(tmp_path), run_id=run_id)


def test_the_run_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path):
    with RunLock(tmp_path, "r1"):
        with pytest.raises(RunLockedError, match="being written"):
            RunLock(tmp_path, "r1").acquire()
        RunLock(tmp_path, "r2").acquire().release()  # another run id is free
    assert not (tmp_path / "_locks" / "r1.lock").exists()
    import socket

    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # every pid is below pid_max: no process has this one
    (tmp_path / "_locks" / "r1.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead}))
    RunLock(tmp_path, "r1").acquire().release()  # its owner exited: stale, taken over


def test_latest_unfinished_run(tmp_path):
    for run_id in ("r1", "r2"):
        RunPartitionSink(str(run_dir(tmp_path, run_id))).write([generations_table(rows(["a"]))], ctx=None)
    os.utime(run_dir(tmp_path, "r1"), (1, 1))
    assert latest_unfinished_run(tmp_path) == "r2"
    mark_finished(tmp_path, "r2")
    assert latest_unfinished_run(tmp_path) == "r1"
    mark_finished(tmp_path, "r1")
    assert latest_unfinished_run(tmp_path) is None


def test_a_small_job_is_split_so_that_every_actor_gets_a_call(tmp_path):
    base = dict(input="in.jsonl", output=str(tmp_path), batch_size=16)
    assert GenerationConfig(**base).with_calls_for_every_actor(64).ray_batch_rows() == 64  # one actor: one call
    assert GenerationConfig(**base, num_actors=2).with_calls_for_every_actor(64).ray_batch_rows() == 32
    assert GenerationConfig(**base, num_actors=4).with_calls_for_every_actor(20).ray_batch_rows() == 16  # >= batch
    assert GenerationConfig(**base, num_actors=2).with_calls_for_every_actor(10**6).ray_batch_rows() == 64
    assert GenerationConfig(**base, num_actors=2, rows_per_call=50).with_calls_for_every_actor(64).ray_batch_rows() == 50
