"""Analysis of a specbatch output directory: DuckDB views, canned reports, plots and per-row quality metrics.

Names resolve lazily (PEP 562): scoring a row (`analysis.quality`) must not import DuckDB."""

from __future__ import annotations

import importlib

_LAZY = {"QUALITY_METRICS": ".quality", "score": ".quality", "connect": ".views"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
