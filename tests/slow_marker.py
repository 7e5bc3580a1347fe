"""The `slow` marker, enforced: a test that loads a real model, starts Ray or runs a subprocess job must carry it, so
that `make test-fast` (`-m "not slow"`) stays a lane of tiny random-weight models.

Two checks, because a marker that can be forgotten will be:
- at collection, the source of the test, of its fixtures and of the module's functions they call is parsed for the
  calls that do those things (`HEAVY_CALLS`); an unmarked hit fails collection with the test and the call named;
- while an unmarked test (its fixtures included) runs, loading pretrained weights, or starting a Python process or
  a Ray server, raises: this catches whatever the source scan cannot see (a helper in another module).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import textwrap
import types
from pathlib import Path

import pytest

# Calls that load a real model, start Ray or run a job in another process (a call inside `with pytest.raises(...)`
# is expected to fail before it does any of that, and is not counted).
HEAVY_CALLS = {
    "Engine", "ModelRunner.load", "AutoModelForCausalLM.from_pretrained", "DecodeRequests", "ScorePerplexity",
    "CompressContext", "ray.init", "init_ray", "subprocess.run", "subprocess.Popen", "subprocess.check_call",
    "subprocess.check_output", "subprocess.call",
}
SCAN_DEPTH = 3  # a test -> its helper -> the helper's helper: deep enough for this suite's run_job-style wrappers


def heavy_calls(item: pytest.Item) -> set[str]:
    """The HEAVY_CALLS in the source of a test function, its fixtures, and the same module's functions they call."""
    functions = [item.function] + [
        definitions[-1].func for definitions in item._fixtureinfo.name2fixturedefs.values() if definitions
    ]
    found: set[str] = set()
    seen: set[types.CodeType] = set()
    for function in functions:
        _scan(function, found, seen, SCAN_DEPTH)
    return found


def _scan(function, found: set[str], seen: set[types.CodeType], depth: int) -> None:
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None or code in seen or _is_outside_tests(code.co_filename):
        return
    seen.add(code)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return
    found.update(name for name in _called_names(tree) if name in HEAVY_CALLS)
    if depth == 0:
        return
    module_globals = getattr(function, "__globals__", {})
    for name in _names(code):
        called = module_globals.get(name)
        if isinstance(called, types.FunctionType):
            _scan(called, found, seen, depth - 1)


def _called_names(node: ast.AST):
    """Dotted names of the calls under node, skipping the bodies of `with pytest.raises(...)`."""
    if isinstance(node, ast.With) and any(_dotted(item.context_expr.func) == "pytest.raises"
                                          for item in node.items if isinstance(item.context_expr, ast.Call)):
        return
    if isinstance(node, ast.Call):
        yield _dotted(node.func)
    for child in ast.iter_child_nodes(node):
        yield from _called_names(child)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _names(code: types.CodeType):
    """Global names a function reads, its nested functions' (lambdas, closures) included."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names(constant)


def _is_outside_tests(filename: str) -> bool:
    return Path(__file__).resolve().parent not in Path(filename).resolve().parents


def check_collected(items: list[pytest.Item]) -> None:
    unmarked = []
    for item in items:
        if isinstance(item, pytest.Function) and item.get_closest_marker("slow") is None:
            calls = heavy_calls(item)
            if calls:
                unmarked.append(f"{item.nodeid} calls {', '.join(sorted(calls))}")
    if unmarked:
        raise pytest.UsageError("tests that load a real model, start Ray or run a subprocess job must be marked "
                                "`slow` (tests/slow_marker.py):\n  " + "\n  ".join(unmarked))


class RuntimeGuard:
    """Raises on a real model load or a Python / Ray process started while an unmarked test runs."""

    def __init__(self):
        self.test: str | None = None  # the unmarked test running now (setup and call), else None
        sys.addaudithook(self._audit)
        self._guard_pretrained_loads()

    @contextlib.contextmanager
    def watching(self, item: pytest.Item):
        self.test = None if item.get_closest_marker("slow") else item.nodeid
        try:
            yield
        finally:
            self.test = None

    def _audit(self, event: str, args: tuple) -> None:
        if self.test is None or event != "subprocess.Popen":
            return
        executable, argv = args[0], args[1]
        program = Path(str(executable or (argv[0] if argv else ""))).name
        if program.startswith("python") or program in ("ray", "raylet", "gcs_server") or executable == sys.executable:
            self._refuse(f"starts a process ({program})")

    def _guard_pretrained_loads(self) -> None:
        from transformers import PreTrainedModel

        original = PreTrainedModel.from_pretrained.__func__
        guard = self

        def from_pretrained(cls, *args, **kwargs):
            if guard.test is not None:
                guard._refuse(f"loads pretrained weights ({cls.__name__})")
            return original(cls, *args, **kwargs)

        PreTrainedModel.from_pretrained = classmethod(from_pretrained)

    def _refuse(self, what: str) -> None:
        raise RuntimeError(f"{self.test} {what} but is not marked slow: mark it `@pytest.mark.slow` "
                           "(tests/slow_marker.py), or make it use the tiny models of tests/tiny_models.py")
