"""The corpus refinement job end to end through Ray (in-process on the session's cluster, with a timeout): scores,
selection, index, resume.
(Its bad arguments: test_job_arguments.py.)"""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.job_runs import run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The cat sat on the mat. The cat sat on the mat again, and again the cat sat on the mat.",
    "Quantum chromodynamics lattice renormalisation: zebra xylophone kumquat.",
    "for i in range(10):\n    print(i)\n",
    "Speculative decoding drafts tokens and verifies them with the target model.",
]


def run(*args):
    return run_job("refine_corpus.py", *args)  # in-process, on the session's Ray cluster


def assert_index_holds(directory, kept_ids) -> None:
    """The refined index's manifest names the model and its tokenizer, and its tokens are the kept texts in order
    (each followed by the separator -1)."""
    from transformers import AutoTokenizer

    from specdec_core.drafters.retrieval_index import load_index, read_manifest
    from specdec_core.model.model_registry import resolve_model_path
    from specdec_core.prompts import tokenizer_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    manifest = read_manifest(directory)
    assert manifest["refined"] and manifest["texts"] == len(kept_ids) and manifest["model"] == "smollm2-135m"
    assert manifest["tokenizer"] == tokenizer_fingerprint(tokenizer)
    expected = []
    for doc in kept_ids:
        expected += tokenizer(TEXTS[int(doc[3:])], add_special_tokens=False)["input_ids"] + [-1]
    assert np.asarray(load_index(str(directory)).tokens).tolist() == expected


def test_refinement_scores_keeps_the_lowest_builds_the_index_and_resumes(ray_cluster, tmp_path):
    from specdec_core.drafters.retrieval_index import read_manifest

    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"id": f"doc{i}", "text": t}).encode() for i, t in enumerate(TEXTS)]
    lines[2:2] = [b'{"text": ""}', b"not json", b'{"text": "caf\xe9 au lait"}'.replace(b"\xe9", b"\xff"),
                  b'{"body": "no text field"}']
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "refined"

    proc = run("--input", str(corpus), "--output", str(out), "--keep", "3", "--tokens-per-forward", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["texts"] == 9 and summary["errors"] == 4 and summary["kept"] == 3

    table = pq.read_table(out / "corpus.parquet").to_pandas().set_index("id")
    assert set(table.index) >= {f"doc{i}" for i in range(5)} and len(table) == 9
    bad = table[table["error"].notna()]
    assert len(bad) == 4 and bad["ppl"].isna().all() and not bad["kept"].any()
    good = table[table["error"].isna()]
    assert good["kept"].sum() == 3
    assert set(good.nsmallest(3, "ppl").index) == set(good.index[good["kept"]])  # exactly the 3 lowest

    assert_index_holds(out / "index", good[good["kept"]].sort_values("ppl").index)

    # Two more texts: --resume scores only them and re-selects over all; the earlier parts stay as they were.
    parts_before = {p.name: p.stat().st_mtime_ns for p in (out / "scores").glob("part-*.parquet")}
    with open(corpus, "ab") as handle:
        handle.write(b'{"id": "doc5", "text": "import os\\nimport sys\\n"}\n{"id": "doc6", "text": "Hello there."}\n')
    proc = run("--input", str(corpus), "--output", str(out), "--keep", "4", "--resume", "--tokens-per-forward", "64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["texts"] == 11 and summary["scored_this_run"] == 2 and summary["kept"] == 4
    parts_after = {p.name: p.stat().st_mtime_ns for p in (out / "scores").glob("part-*.parquet")}
    assert all(parts_after.get(name) == stamp for name, stamp in parts_before.items())
    assert read_manifest(out / "index")["texts"] == 4

    # Without --resume the directory is refused; other scoring settings on --resume are refused too.
    proc = run("--input", str(corpus), "--output", str(out))
    assert proc.returncode == 2 and "--resume" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run("--input", str(corpus), "--output", str(out), "--resume", "--window", "512")
    assert proc.returncode == 2 and "window" in proc.stderr
