"""ACLSum workloads (aclsum==0.1.2, MIT): aspect summarization of papers, and RAG questions over full papers."""

from __future__ import annotations

import json
import re

from .packages import package_file

ASPECTS = ("challenge", "approach", "outcome")
QUESTIONS = {
    "challenge": "What problem or challenge does the paper \"{title}\" address?",
    "approach": "What approach does the paper \"{title}\" propose?",
    "outcome": "What are the main results of the paper \"{title}\"?",
}


def _detok(sentences: list[str]) -> str:
    """ACLSum sentences are space-tokenized ("word ,"): glue punctuation back."""
    text = " ".join(sentences)
    return re.sub(r" ([.,;:!?)\]])", r"\1", text).replace("( ", "(").replace("[ ", "[")


def _rows(split: str) -> list[dict]:
    path = package_file("aclsum", "dataset", f"{split}.jsonl")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def summarization_rows(limit: int | None = None, split: str = "test") -> list[dict]:
    """One row per paper: abstract + introduction + conclusion in, the three aspect summaries as reference."""
    rows = []
    for paper in _rows(split)[:limit]:
        sections = paper["sentences"]
        document = "\n\n".join(_detok(sections[s]) for s in ("abstract", "introduction", "conclusion") if s in sections)
        rows.append({
            "id": f"aclsum-{split}-{paper['id']}",
            "task": "summarization",
            "prompt": f"Summarize the following paper in one paragraph.\n\nTitle: {paper['title']}\n\n{document}",
            "reference": " ".join(paper["summary"][a] for a in ASPECTS),
        })
    return rows


def paper_passages(paper_id: str) -> list[str]:
    """The full paper's body as passages (one per parsed paragraph), with section names."""
    data = json.loads(package_file("aclsum", "dataset", "paper_jsons", f"{paper_id}.json").read_text(encoding="utf-8"))
    passages = [f"[{p['section']}] {p['text']}" if p.get("section") else p["text"]
                for p in data["pdf_parse"]["body_text"] if p.get("text")]
    if data.get("abstract"):
        passages.insert(0, f"[Abstract] {data['abstract']}")
    return passages


def rag_rows(limit: int | None = None, split: str = "test") -> list[dict]:
    """Three questions per paper (its aspects), the paper's passages as `context`, the aspect summary as reference.

    Question rows: the prompt stage composes the prompt (task_prompts.py) from the question and the first
    --max-context-chars of the passages (compressed with --compress-context); `context` keeps the whole paper for
    drafters that draw from more than the prompt.
    """
    rows = []
    for paper in _rows(split):
        passages = paper_passages(paper["id"])
        context = "\n\n".join(passages)
        for aspect in ASPECTS:
            question = QUESTIONS[aspect].format(title=paper["title"])
            rows.append({
                "id": f"aclsum-rag-{split}-{paper['id']}-{aspect}",
                "task": "rag",
                "question": question,
                "context": context,
                "reference": paper["summary"][aspect],
            })
            if limit is not None and len(rows) >= limit:
                return rows
    return rows
