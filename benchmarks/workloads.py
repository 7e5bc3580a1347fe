"""Benchmark prompts: renames in standard-library functions (expected output computable) and ACLSum summaries."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import textwrap
from collections import Counter
import importlib.util
from pathlib import Path

# Modules whose source ships with every CPython; functions are picked deterministically from them.
STDLIB_MODULES = ("textwrap", "shlex", "argparse", "difflib", "csv", "tarfile", "zipfile", "ftplib", "smtplib",
                  "imaplib", "mailbox", "calendar", "pydoc", "configparser", "gettext", "locale", "ast", "dis",
                  "inspect", "tokenize", "optparse", "http.cookiejar", "urllib.parse", "pprint", "pickletools")


def _candidate_identifier(source: str) -> str | None:
    """The most used parameter or local name (>= 3 chars, not self/cls): the one to rename."""
    tree = ast.parse(source)
    func = tree.body[0]
    params = {a.arg for a in func.args.args + func.args.kwonlyargs}
    assigned = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    uses = Counter(n.id for n in ast.walk(func) if isinstance(n, ast.Name))
    uses.update(a.arg for a in func.args.args + func.args.kwonlyargs)
    names = [(count, name) for name, count in uses.items()
             if name in params | assigned and name not in ("self", "cls") and len(name) >= 3]
    return max(names)[1] if names else None


def stdlib_rename_tasks(count: int = 10, min_lines: int = 60, max_lines: int = 150) -> list[dict]:
    tasks = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if not inspect.isfunction(obj) or obj.__module__ != module_name:
                continue
            try:
                source = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if not min_lines <= source.count("\n") <= max_lines:
                continue
            old = _candidate_identifier(source)
            if old is None:
                continue
            new = f"{old}_renamed" if not old.endswith("_") else f"{old}renamed"
            expected = re.sub(rf"\b{re.escape(old)}\b", new, source)
            prompt = (f"Rename the variable `{old}` to `{new}` in this Python function. "
                      f"Output the complete updated function and nothing else.\n\n```python\n{source}```")
            tasks.append({"id": f"{module_name}.{name}", "task": "code_edit", "prompt": prompt,
                          "reference": f"```python\n{expected}```"})
            break  # one function per module keeps the set varied
        if len(tasks) == count:
            break
    return tasks


def _detok(sentences: list[str]) -> str:
    text = " ".join(sentences)
    return re.sub(r" ([.,;:!?)\]])", r"\1", text).replace("( ", "(").replace("[ ", "[")


def aclsum_summary_tasks(count: int = 10, split: str = "test") -> list[dict]:
    # Locate the data without importing the package (its __init__ needs `sienna`, which nothing here uses).
    spec = importlib.util.find_spec("aclsum")
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset" / f"{split}.jsonl"
    tasks = []
    for line in path.read_text(encoding="utf-8").splitlines()[:count]:
        row = json.loads(line)
        sections = row["sentences"]
        document = "\n\n".join(_detok(sections[s]) for s in ("abstract", "introduction", "conclusion") if s in sections)
        prompt = f"Summarize the following paper in one paragraph.\n\nTitle: {row['title']}\n\n{document}"
        reference = " ".join(row["summary"].values())
        tasks.append({"id": row["id"], "task": "summarization", "prompt": prompt, "reference": reference})
    return tasks
