"""Analysis of a specbatch output directory: DuckDB views, canned reports, plots and per-row quality metrics."""

from .quality import QUALITY_METRICS, score
from .views import connect

__all__ = ["QUALITY_METRICS", "connect", "score"]
