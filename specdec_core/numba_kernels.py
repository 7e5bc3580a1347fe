"""Kernels numba compiles on first use, cached on disk under $SPECBATCH_CACHE/numba/<digest> (numba_cache_dir)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

from .model_registry import cache_root

log = logging.getLogger(__name__)


@functools.cache
def numba_cache_dir() -> str:
    """$SPECBATCH_CACHE/numba/<digest of every specdec_core source that imports numba>. numba checks a cached function
    against its own file only, so a kernel whose helper in another file changed (fast_exp.py's peak, say) would load
    its old machine code; a new digest is a new folder, after an edit here or an upgrade."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        text = path.read_bytes()
        if b"from numba" in text or b"import numba" in text:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + text)
    return str(cache_root() / "numba" / digest.hexdigest()[:16])


def use_numba_cache() -> None:
    """Point numba's disk cache at numba_cache_dir() (unless NUMBA_CACHE_DIR is set): before numba compiles."""
    os.environ.setdefault("NUMBA_CACHE_DIR", numba_cache_dir())


class LazyKernel:
    """`compile()` once, on the first call; None (and one log line) where numba cannot compile it."""

    def __init__(self, compile, what: str, fallback: str = ""):
        self._compile, self.what, self.fallback = compile, what, fallback
        self._kernel = None
        self.unavailable: str | None = None  # why it could not be compiled

    def __call__(self):
        if self._kernel is None and self.unavailable is None:
            use_numba_cache()
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
