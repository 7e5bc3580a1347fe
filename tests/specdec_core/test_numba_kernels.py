"""The compiled kernels' disk cache and fallback: the cache folder changes with anything the machine code depends
on, and a kernel that fails to compile turns itself off so its torch path gives the same tokens."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec_core import numba_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_the_cache_key_covers_every_source_the_versions_and_the_cpu(tmp_path, monkeypatch):
    """A constant in a wrapper file that does not import numba (bf16_dot.ROWS is compiled into the dot kernel)
    changes the key; so do numba's and llvmlite's versions and the CPU's features."""
    import llvmlite
    import numba
    from llvmlite import binding

    copy = tmp_path / "specdec_core"
    shutil.copytree(ROOT / "specdec_core", copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = numba_kernels.cache_key(copy)
    assert numba_kernels.cache_key(copy) == before  # stable
    wrapper = copy / "bf16_dot.py"
    text = wrapper.read_text()
    assert "\nROWS = 8 " in text and "from numba" not in text and "import numba" not in text
    wrapper.write_text(text.replace("\nROWS = 8 ", "\nROWS = 4 "))
    edited = numba_kernels.cache_key(copy)
    assert edited != before
    monkeypatch.setattr(numba, "__version__", "0.0.1")
    assert numba_kernels.cache_key(copy) not in (before, edited)
    monkeypatch.undo()
    monkeypatch.setattr(llvmlite, "__version__", "0.0.1")
    assert numba_kernels.cache_key(copy) != edited
    monkeypatch.undo()
    features = binding.get_host_cpu_features()
    features["avx512bf16"] = not features.get("avx512bf16", False)
    monkeypatch.setattr(binding, "get_host_cpu_features", lambda: features)
    assert numba_kernels.cache_key(copy) != edited


BROKEN_COMPILER = """
import json, logging, sys
import numba.core.dispatcher

def broken(self, signature):
    raise RuntimeError("injected: this LLVM cannot compile")

numba.core.dispatcher.Dispatcher.compile = broken  # every numba compile (and cache load) fails from here on
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import torch
from specdec_core import numba_kernels
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
