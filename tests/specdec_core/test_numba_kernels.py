"""The compiled kernels' disk cache and fallback: the cache folder changes with anything the machine code depends
on, and a kernel that fails to compile turns itself off so its torch path gives the same tokens."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_core.kernels import numba_kernels

ROOT = Path(__file__).resolve().parents[2]


def fresh_process(code: str, cache: Path) -> str:
    """`code`'s stdout, run in a new process with its cache under `cache` and NUMBA_CACHE_DIR unset."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(SPECBATCH_CACHE=str(cache), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_the_cache_key_covers_every_source_the_versions_and_the_cpu(tmp_path, monkeypatch):
    """A constant in a file that does not import numba (layouts.DOT_ROWS is compiled into the dot kernel)
    changes the key; so do numba's and llvmlite's versions and the CPU's features."""
    from llvmlite import binding

    copy = tmp_path / "specdec_core"
    shutil.copytree(ROOT / "specdec_core", copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = numba_kernels.cache_key(copy)
    assert numba_kernels.cache_key(copy) == before  # stable
    wrapper = copy / "kernels" / "layouts.py"
    text = wrapper.read_text()
    assert "\nDOT_ROWS = 8 " in text and "from numba" not in text and "import numba" not in text
    wrapper.write_text(text.replace("\nDOT_ROWS = 8 ", "\nDOT_ROWS = 4 "))
    edited = numba_kernels.cache_key(copy)
    assert edited != before
    import importlib.metadata

    real_version = importlib.metadata.version
    for package in ("numba", "llvmlite"):
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name, package=package: "0.0.1" if name == package else real_version(name))
        assert numba_kernels.cache_key(copy) not in (before, edited), package
        monkeypatch.undo()
    features = binding.get_host_cpu_features()
    features["avx512bf16"] = not features.get("avx512bf16", False)
    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: features)
    assert numba_kernels.cache_key(copy) != edited


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_numba_reads_the_cache_folder_the_key_names(tmp_path):
    """numba reads NUMBA_CACHE_DIR once, when it is imported: computing the key must not import it first (it once
    did, and numba cached into the source tree, loading stale and unvectorised machine code)."""
    code = ("import torch\n"
            "from specdec_core.kernels import numba_kernels, panel_linear\n"
            "kernel = panel_linear.kernels[torch.float32]\n"  # compiled at its first use: cached there
            "assert kernel() is not None, kernel.unavailable\n"
            "import numba\n"
            "print(numba.config.CACHE_DIR == numba_kernels.numba_cache_dir(), numba_kernels.numba_cache_dir())")
    same, folder = fresh_process(code, tmp_path).split()
    assert same == "True" and folder.startswith(str(tmp_path / "numba"))
    assert list(Path(folder).rglob("*.nbi")), "nothing was cached in the key's folder"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_kernel_compiled_after_numba_was_imported_elsewhere_is_still_vectorised(tmp_path):
    """A script that imports numba before the engine: setting NUMBA_CACHE_DIR then changes the environment after
    numba read it, numba reads its settings again at the next compile, and that once reset the SLP vectoriser the
    kernel had just turned on: the fp32 panel kernel came out with scalar FMAs only, cached so for every later
    process."""
    code = ("import re, numba, torch\n"
            "from specdec_core.kernels import panel_linear\n"
            "dispatcher = panel_linear.kernels[torch.float32]()\n"
            "assembly = dispatcher.inspect_asm(dispatcher.signatures[0])\n"
            "print(len(re.findall(r'vfmadd\\w*ps\\s+[^\\n]*%[yz]mm', assembly)), "
            "len(re.findall(r'vfmadd\\w*ss\\s', assembly)))")
    packed, scalar = map(int, fresh_process(code, tmp_path).split())
    assert packed > 0 and scalar == 0, (packed, scalar)


BROKEN_COMPILER = """
import json, logging, sys
import numba.core.dispatcher

def broken(self, signature):
    raise RuntimeError("injected: this LLVM cannot compile")

numba.core.dispatcher.Dispatcher.compile = broken  # every numba compile (and cache load) fails from here on
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import torch
from specdec_core.kernels import numba_kernels
from specdec_core.engine import Engine, EngineConfig
from specdec_core.warm_up import warm_up
from tests.prompts import lossless_items

torch.set_num_threads(2)
engine = Engine(EngineConfig(model="smollm2-135m", dtype="float32", device="cpu"))
warm_up(engine, ["ar", "pld"], 2)
items = lossless_items(engine)[:3]
out = {method: {str(key): result.get("output_token_ids") or result["error"]  # an error row: its message
                for key, result in engine.decode_batch(items, method, batch_size=3)} for method in ("ar", "pld")}
out["off"] = sorted(k.what for k in numba_kernels.KERNELS if k.unavailable and "injected" in k.unavailable)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kernels_that_fail_to_compile_fall_back_and_the_tokens_equal_ars(lossless_reference, tmp_path):
    """In a process where numba cannot compile anything, the warm-up finds each kernel's failure, the kernel turns
    itself off with one log line naming it, and the real model's tokens (ar and pld, batched) equal ar's with the
    kernels."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", BROKEN_COMPILER], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    used = {"compiled RoPE and cache write", "the compiled residual add, RMSNorm and SiLU gate",
            "the torch.float32 panel linear kernel", "compiled prompt lookup"}  # what fp32 forwards and pld call
    assert used <= set(out["off"]), out["off"]
    for what in out["off"]:
        assert proc.stderr.count(f"{what} unavailable (RuntimeError: injected") == 1, what
    for method in ("ar", "pld"):
        for key, ids in out[method].items():
            assert ids == lossless_reference[key]["output_token_ids"], (method, key)


def test_no_cached_kernel_closes_over_another_compiled_function():
    """numba's disk cache keys a closure by the pickled values it closes over, and a compiled function pickles with
    a fresh id in each process: such a kernel was found in no later process's cache and compiled again in every one
    (the fp32 attention: ~8 s of each job's warm-up, and a new cache entry each time). Kernels call other compiled
    functions as module globals instead (the *_kernel.py modules)."""
    import importlib
    import pkgutil

    from numba.core.dispatcher import Dispatcher

    import specdec_core

    for module in pkgutil.walk_packages(specdec_core.__path__, "specdec_core."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)  # every LazyKernel registers itself in KERNELS when its module loads
    checked = 0
    for kernel in numba_kernels.KERNELS:
        compiled = kernel()
        for dispatcher in compiled if isinstance(compiled, tuple) else (compiled,):
            closure = getattr(getattr(dispatcher, "py_func", None), "__closure__", None) or ()
            captured = [cell.cell_contents for cell in closure]
            assert not [value for value in captured if isinstance(value, Dispatcher)], (kernel.what, captured)
            checked += dispatcher is not None
    assert checked >= 10, checked
