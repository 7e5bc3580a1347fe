"""Kernels numba compiles on first use, cached on disk under $SPECBATCH_CACHE/numba (both CPU attentions)."""

from __future__ import annotations

import logging
import os

from .model_registry import cache_root

log = logging.getLogger(__name__)


class LazyKernel:
    """`compile()` once, on the first call; None (and one log line) where numba cannot compile it."""

    def __init__(self, compile, what: str, fallback: str = ""):
        self._compile, self.what, self.fallback = compile, what, fallback
        self._kernel = None
        self.unavailable: str | None = None  # why it could not be compiled

    def __call__(self):
        if self._kernel is None and self.unavailable is None:
            os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_root() / "numba"))
            try:
                self._kernel = self._compile()
            except Exception as exc:  # no numba, or no compiler for this machine
                self.unavailable = f"{type(exc).__name__}: {exc}"
                log.warning("%s unavailable (%s)%s", self.what, self.unavailable, self.fallback)
        return self._kernel


def use_torch_threads() -> None:
    """numba's parallel loops on as many threads as torch's kernels use."""
    import torch
    from numba import config, get_num_threads, set_num_threads

    threads = min(torch.get_num_threads(), config.NUMBA_NUM_THREADS)
    if get_num_threads() != threads:
        set_num_threads(threads)
