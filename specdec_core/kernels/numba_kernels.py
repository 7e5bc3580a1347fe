"""Kernels numba compiles on first use, cached on disk under $SPECBATCH_CACHE/numba/<digest> (numba_cache_dir)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import threading
from pathlib import Path

from ..defaults import cache_root

log = logging.getLogger(__name__)


@functools.cache
def numba_cache_dir() -> str:
    """$SPECBATCH_CACHE/numba/<cache_key()>: a new folder after any edit, upgrade or move to another CPU."""
    return str(cache_root() / "numba" / cache_key())


def cache_key(root: Path | None = None) -> str:
    """A digest of everything the machine code depends on. numba checks a cached function against its own file only,
    but the kernels compile in constants and helpers from other files (layouts.DOT_ROWS, fast_exp's peak, ...): so
    every specdec_core source, plus the numba and llvmlite versions and the CPU's name and features."""
    from importlib.metadata import version

    from llvmlite import binding  # not numba: importing it reads NUMBA_CACHE_DIR, which use_numba_cache sets after

    root = root or Path(__file__).resolve().parents[1]  # all of specdec_core
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"numba {version('numba')}\0llvmlite {version('llvmlite')}\0".encode())
    digest.update(f"{binding.get_host_cpu_name()}\0{binding.get_host_cpu_features().flatten()}".encode())
    return digest.hexdigest()[:16]


def use_numba_cache() -> None:
    """Point numba's disk cache at numba_cache_dir() (unless NUMBA_CACHE_DIR is set): before numba compiles."""
    os.environ.setdefault("NUMBA_CACHE_DIR", numba_cache_dir())


@contextlib.contextmanager
def slp_vectorized():
    """LLVM's SLP vectoriser on for the compiles inside (numba leaves it off; the generated kernels' register-blocked
    sums stay scalar without it). numba reads its settings from the environment again at a compile whenever the
    environment changed since it last read them (use_numba_cache sets NUMBA_CACHE_DIR), which would undo the
    override: so they are read first."""
    from numba.core import config

    config.reload_config()
    saved, config.SLP_VECTORIZE = config.SLP_VECTORIZE, 1
    try:
        yield
    finally:
        config.SLP_VECTORIZE = saved


def load_generated(name: str, source: str):
    """The module `name` of generated kernel `source`, written under the numba cache folder and imported from there
    (numba's disk cache finds a function through its file and its module's name, so the compiled code is kept across
    processes). Rewritten only when the source changed, atomically: actors starting together never import half a
    file."""
    folder = Path(os.environ.get("NUMBA_CACHE_DIR", numba_cache_dir()))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != source:
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(source)
        os.replace(temporary, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class KernelUnavailableError(RuntimeError):
    """A kernel failed to compile at a call: it is off from now on, and the forward that called it failed. Run the
    forward again (warm_up.py does, the decode operator's row-by-row retry does): its torch path answers."""


class LazyKernel:
    """`compile()` once, on the first call; None (and one log line) where numba cannot compile it. numba compiles a
    function again at a call with new argument types, inside a forward: each dispatcher `compile()` returns is
    guarded there too, so a failure there turns the kernel off (one log line, KernelUnavailableError) instead of
    failing every later forward. Every LazyKernel made is listed in KERNELS."""

    def __init__(self, compile, what: str, fallback: str = ""):
        self._compile, self.what, self.fallback = compile, what, fallback
        self._kernel = None
        self.unavailable: str | None = None  # why it could not be compiled
        KERNELS.append(self)

    def __call__(self):
        if self._kernel is None and self.unavailable is None:
            use_numba_cache()
            try:
                kernel = self._compile()
                for dispatcher in kernel if isinstance(kernel, tuple) else (kernel,):
                    self._guard(dispatcher)
                self._kernel = kernel
            except Exception as exc:  # no numba, or no compiler for this machine
                self._turn_off(exc)
        return self._kernel

    def _turn_off(self, exc: Exception) -> None:
        self._kernel, self.unavailable = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
        log.warning("%s unavailable (%s)%s", self.what, self.unavailable, self.fallback)

    def _guard(self, dispatcher) -> None:
        """numba compiles at a call through the dispatcher's own `compile` (its disk cache loads there too)."""
        if not hasattr(dispatcher, "compile"):
            return
        compile = dispatcher.compile

        def guarded(signature):
            from numba.core.errors import ForceLiteralArg

            try:
                return compile(signature)
            except ForceLiteralArg:  # numba's own request to compile again with literal arguments
                raise
            except Exception as exc:
                self._turn_off(exc)
                raise KernelUnavailableError(f"{self.what} failed to compile: {self.unavailable}") from exc

        dispatcher.compile = guarded


KERNELS: list[LazyKernel] = []


_threads = threading.local()  # torch's thread count this thread last gave numba (numba's setting is per thread)


def use_torch_threads() -> None:
    """numba's parallel loops on as many threads as torch's kernels use. Called before every parallel kernel, so
    it returns at once while torch's count is the one it last set (its imports and numba's query were a visible
    share of a small batch's step)."""
    import torch

    wanted = torch.get_num_threads()
    if getattr(_threads, "torch", None) == wanted:
        return
    from numba import config, get_num_threads, set_num_threads

    threads = min(wanted, config.NUMBA_NUM_THREADS)
    if get_num_threads() != threads:
        set_num_threads(threads)
    _threads.torch = wanted
