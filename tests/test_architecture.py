"""The shape of the code (issue 53): specdec_core's imports run one way, no import circles, no long parameter lists,
few function-level imports. Read from the sources with `ast`, so it needs no model and runs in a second."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OWN = ("specdec_core", "operators", "pipelines", "jobs", "corpora", "analysis", "contract", "benchmarks")
ABOVE_THE_ENGINE = {"corpora", "operators", "pipelines", "jobs", "analysis", "benchmarks"}
MAX_TOP_LEVEL_MODULES = 15
MAX_PARAMETERS = 10
MAX_FUNCTION_LEVEL_IMPORTS = 43  # each compiled kernel's wrapper imports its numba module when first used
# Rooms, lowest first: a module may import its own room, a lower one, or the base (modules that import nothing of ours
# but each other). loop/ and drafters/ are peers.
RANKS = {"kernels": 0, "model": 1, "loop": 2, "drafters": 2, "top": 3}
BASE = {"specdec_core.errors", "specdec_core.defaults", "specdec_core.prompts", "specdec_core.method_options"}


def _sources(*packages):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"))


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, node) -> list[str]:
    """The absolute module names an import statement names (a `from pkg import name` also names pkg.name)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = _module(path).split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def _type_checking_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {child.lineno for child in ast.walk(node) if hasattr(child, "lineno")}
    return lines


def _engine_graph() -> dict[str, set[str]]:
    """specdec_core module -> the specdec_core modules it imports anywhere (function-level too, TYPE_CHECKING aside)."""
    sources = dict(_sources("specdec_core"))
    modules = {_module(path) for path in sources}
    graph = {}
    for path, tree in sources.items():
        hidden = _type_checking_lines(tree)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in hidden:
                edges |= {name for name in _imported(path, node) if name in modules}
        graph[_module(path)] = edges - {_module(path)} - {"specdec_core"}
    return graph


def test_specdec_core_has_no_import_circle():
    graph = _engine_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError(" -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else "top"


def test_imports_run_down_the_rooms():
    """top -> loop / drafters -> model -> kernels, with errors, defaults, prompts and method options below them all."""
    graph = _engine_graph()
    upward = [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
              if target not in BASE and RANKS[_room(target)] > RANKS[_room(module)]]
    assert not upward, upward
    assert not any(graph[module] - BASE for module in BASE), {module: graph[module] for module in BASE}


def test_the_packages_public_names_resolve():
    import specdec_core

    for name in specdec_core.__all__:
        assert getattr(specdec_core, name) is not None, name


def test_specdec_core_imports_nothing_built_on_it():
    wrong = []
    for path, tree in _sources("specdec_core"):
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                top = _imported(path, node)[0].split(".")[0]
                if top in ABOVE_THE_ENGINE:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {top}")
    assert not wrong, wrong


def test_specdec_core_keeps_few_modules_at_its_top():
    modules = [path.name for path in (ROOT / "specdec_core").glob("*.py")]
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, sorted(modules)
    for room in ("drafters", "kernels", "loop", "model"):
        assert ast.get_docstring(ast.parse((ROOT / "specdec_core" / room / "__init__.py").read_text())), room


def _triton_kernel(node) -> bool:
    """A Triton kernel's parameters are its launch interface (pointers, strides, compile-time sizes), not a design."""
    return any(ast.unparse(decorator).startswith("triton.jit") for decorator in node.decorator_list)


def test_no_function_takes_more_than_ten_parameters():
    long = []
    for path, tree in _sources(*OWN):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _triton_kernel(node):
                args = node.args
                count = (len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + bool(args.vararg)
                         + bool(args.kwarg))
                if args.args and args.args[0].arg in ("self", "cls"):
                    count -= 1
                if count > MAX_PARAMETERS:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count})")
    assert not long, long


def test_few_function_level_imports_of_the_projects_own_modules():
    """Each one is lazy for a reason (torch or numba kept out of a light path); everything else imports at the top."""
    found = []
    for path, tree in _sources(*OWN):
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and (
                        getattr(node, "level", 0) or _imported(path, node)[0].split(".")[0] in OWN + ("tests",)):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(set(found)) <= MAX_FUNCTION_LEVEL_IMPORTS, sorted(set(found))
