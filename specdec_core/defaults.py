"""Defaults that the CLI, the jobs and their configs read without importing the engine (torch, transformers)."""

import os
from pathlib import Path

# The model a job, the CLI and the engine load when none is named: the smallest in the registry (model_registry.py).
DEFAULT_MODEL = "smollm2-135m"

# New tokens per request when neither the row nor the caller says (each job may choose its own: an edit job wants more).
DEFAULT_MAX_NEW_TOKENS = 256

# Rows decoded at once when the caller does not say: on 2-core CPUs batched decoding keeps gaining up to 16 rows
# (decisions.md: specdec_core/defaults.py); GPUs want far more (pass --batch-size).
DEFAULT_BATCH_SIZE = 16

# Output tokens a decode actor's job memory holds per method (suffix, auto): its suffix trees stay a few hundred
# megabytes (decisions.md: specdec_core/defaults.py).
DEFAULT_MEMORY_TOKENS = 100_000

# --dtype: "auto" picks bf16 where the CPU computes in it, else fp32 (model/hardware.py); a draft model may be int8.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DRAFTER_DTYPE_CHOICES = (*DTYPE_CHOICES, "int8")

# --deterministic: "auto" turns it on where it costs nothing (ModelRunner.determinism_costs_nothing).
DETERMINISM_MODES = ("auto", "on", "off")
DEFAULT_DETERMINISTIC = "auto"


def determinism_mode(value: str | bool) -> str:
    """--deterministic's value as one of DETERMINISM_MODES (True / False, as configs before "auto" held it: on /
    off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value not in DETERMINISM_MODES:
        raise ValueError(f"deterministic must be one of {', '.join(DETERMINISM_MODES)}, not {value!r}")
    return value


def cache_root() -> Path:
    """Where installed models, compiled kernels, head rankings and vocabulary maps are kept: $SPECBATCH_CACHE."""
    return Path(os.environ.get("SPECBATCH_CACHE", Path.home() / ".cache" / "specbatch"))
