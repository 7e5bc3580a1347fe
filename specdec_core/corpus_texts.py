"""Texts of a corpus to index or score: a JSONL file (one text per line in a field), a plain text file, or a
directory of files (recursively, by glob). Unusable texts (empty, undecodable, not a string) are skipped and counted;
they never stop the read."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SpecbatchError


def read_texts(source: str | Path, text_field: str = "text", glob: str = "*.txt",
               limit: int | None = None) -> tuple[list[tuple[str, str]], int]:
    """-> ([(id, text)], skipped). Ids: 'line-N' for JSONL lines (or the row's `id`), the relative path for files."""
    path = Path(source)
    if not path.exists():
        raise SpecbatchError(f"input not found: {source}")
    texts: list[tuple[str, str]] = []
    skipped = 0

    def keep(key: str, text) -> bool:
        nonlocal skipped
        if isinstance(text, str) and text.strip():
            texts.append((key, text))
        else:
            skipped += 1
        return limit is not None and len(texts) >= limit

    if path.is_dir():
        for file in sorted(p for p in path.rglob(glob) if p.is_file()):
            try:
                text = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                text = None
            if keep(str(file.relative_to(path)), text):
                break
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8", errors="replace") as handle:
            for number, line in enumerate(handle, 1):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                text = row.get(text_field) if isinstance(row, dict) else None
                key = str(row.get("id")) if isinstance(row, dict) and row.get("id") is not None else f"line-{number}"
                if keep(key, text):
                    break
    else:
        try:
            keep(path.name, path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise SpecbatchError(f"{source} is not UTF-8 text") from None
    return texts, skipped
