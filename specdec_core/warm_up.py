"""Warm-up before timing: a short untimed pass of each method, then the engine forgets what the passes learned.

A process's first forwards pay for things no later forward pays for: numba compiling its kernels (or loading them
from the disk cache), and the first batched prefill's allocations. A job that timed its first method through them
reported that method slow and the next one fast (decisions.md: specdec_core/warm_up.py). So a decode actor warms
up every method it will run, on synthetic prompts shaped like a job's (one prompt longer than a prefill forward,
short ones beside it, text that repeats so drafts are verified), before its first timed pass. On a CPU its prefill
forwards are narrower than a job's (WARM_PREFILL_TOKENS): what they compile and load is the same, and a CPU
prefill's cost grows with its tokens.

It is also where a kernel that fails to compile is found and turned off (numba_kernels.KernelUnavailableError):
the pass is run again, on the kernel's torch path.

Once warm, a process that keeps its engine freezes its heap (`freeze_heap`): the objects of torch, transformers,
numba and the loaded model leave the cycle collector's full passes, which otherwise scan all of them every few
hundred decode steps, a pause of the whole loop each time (decisions.md, issue 50, session 29).
"""

from __future__ import annotations

import gc
import logging
import time

from .engine import BatchItem
from .kernels.numba_kernels import KERNELS, KernelUnavailableError
from .loop.prefill_plan import default_budget
from .loop.requests import DecodeParams

log = logging.getLogger(__name__)

NEW_TOKENS = 16  # per row: enough decode and verify steps for every step kernel to run
# A CPU warm-up's prefill tokens a forward: past 512 rows, the kernel plan's widest row bucket (kernel_plan.BUCKETS),
# so its long prompt still goes in two chunks; a job's 1,024 compiled nothing more, at a cost to every actor's start
# (decisions.md, session 42).
WARM_PREFILL_TOKENS = 576
SHORT_SENTENCES = 2  # of each short prompt: enough repeats for every copying method to draft
ATTEMPTS = 4  # passes of one method, each after a kernel turned itself off
SENTENCE = "The lamp on the desk is green, and the book beside it is open at page {}. "


def warm_up(engine, methods: list[str], batch_size: int, options=None) -> float:
    """Decode a few synthetic prompts with each method (untimed), then engine.forget(); -> the seconds it took."""

    started = time.perf_counter()
    budget = prefill_budget(engine.target.device)
    items = [BatchItem(key, ids, DecodeParams(max_new_tokens=NEW_TOKENS))
             for key, ids in enumerate(_prompts(engine, batch_size, budget))]
    for method in methods:
        for attempt in range(ATTEMPTS):
            off = _kernels_off()
            try:
                errors = [r["error"] for _, r in engine.decode_batch(items, method, options, batch_size,
                                                                     prefill_tokens=budget) if r["error"]]
            except KernelUnavailableError as exc:  # a step's kernel turned itself off
                errors = [str(exc)]
            if not errors:
                break
            log.info("warm-up of %s, attempt %d: %s", method, attempt + 1, errors[0])
            if _kernels_off() == off:  # no kernel turned off: another try would fail the same way
                break
    engine.forget()
    return time.perf_counter() - started


def prefill_budget(device) -> int:
    """The warm-up's prefill tokens a forward: a job's on a GPU (whose first prefills pick its attention), else
    WARM_PREFILL_TOKENS."""
    budget = default_budget(device)
    return budget if not str(device).startswith("cpu") else min(budget, WARM_PREFILL_TOKENS)


def freeze_heap() -> int:
    """Collect, then move every object alive now out of the cycle collector's reach (gc.freeze): later full
    collections scan only what the process makes from here on. For processes that keep their engine to the end (a
    decode actor, a batch command, a benchmark): a cycle of these objects that becomes garbage later is never
    freed. -> objects frozen in all."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _kernels_off() -> int:
    return sum(kernel.unavailable is not None for kernel in KERNELS)


def _prompts(engine, batch_size: int, budget: int) -> list[list[int]]:
    """batch_size prompts (at most 16): the first longer than one prefill forward of `budget` tokens (chunked
    prefill, the long-prompt kernels) where the model's positions allow, the others ~40 tokens; all repeat
    themselves, so copying methods draft."""
    sentences = [SENTENCE.format(page % 5) for page in range(400)]
    long_tokens = min(budget + 64, engine.target.max_positions - NEW_TOKENS - 8)
    ids = engine.prompt_ids("Copy this out: " + "".join(sentences))
    rows = [ids[:min(len(ids), long_tokens)]]
    for row in range(1, min(batch_size, 16)):
        rows.append(engine.prompt_ids(f"Copy this out ({row}): " + "".join(sentences[row:row + SHORT_SENTENCES])))
    return rows
