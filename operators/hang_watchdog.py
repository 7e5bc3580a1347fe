"""A decode actor's hang watchdog: when its decoder has finished no forward for too long, it ends the actor's process.

A forward stuck inside native code (a deadlock in a kernel, a device that stopped answering) cannot be interrupted
from Python, and the row timeout is only checked between steps. Ending the process turns the hang into a crash,
which the job already handles: the crash journal counts it, the actor is replaced, and a row that hangs every time
it is decoded ends as an error row after its batch's attempts (crash_journal.py), as a row that crashes does.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

# The default limit: this many times the slowest forward (or step) the actor has seen, and never below the floor,
# as a pass's first forward has nothing to go by (a long prompt's prefill, numba compiling its kernels).
HANG_STEP_MULTIPLE = 20.0
HANG_FLOOR_S = 300.0


def default_limit(slowest_forward_s: float) -> float:
    return max(HANG_FLOOR_S, HANG_STEP_MULTIPLE * slowest_forward_s)


class HangWatchdog:
    """Watches one decoder at a time (`watching`), from a daemon thread that wakes every `poll_s` seconds.

    timeout_s  the limit in seconds (--hang-timeout-s); None: default_limit of the slowest forward seen
    on_hang    called once, with the reason, when the limit is passed (default: end the process)
    """

    def __init__(self, timeout_s: float | None = None, on_hang: Callable[[str], None] | None = None,
                 poll_s: float = 1.0):
        self.timeout_s = timeout_s
        self.on_hang = on_hang or end_process
        self.poll_s = poll_s
        self.slowest_s = 0.0  # over the passes this actor has finished
        self._decoder = None
        self._fired = threading.Event()
        threading.Thread(target=self._watch, name="hang-watchdog", daemon=True).start()

    def limit(self, decoder) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return default_limit(max(self.slowest_s, decoder.slowest_forward_s))

    @contextmanager
    def watching(self, decoder):
        """`decoder` (a BatchDecoder: last_progress, slowest_forward_s) is watched inside this block."""
        self._decoder = decoder
        try:
            yield decoder
        finally:
            self._decoder = None
            self.slowest_s = max(self.slowest_s, decoder.slowest_forward_s)

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def _watch(self) -> None:
        while not self._fired.is_set():
            time.sleep(self.poll_s)
            decoder = self._decoder
            if decoder is None:
                continue
            idle, limit = time.monotonic() - decoder.last_progress, self.limit(decoder)
            if idle > limit:
                self._fired.set()
                self.on_hang(f"no forward finished for {idle:.0f} s (the hang limit is {limit:.0f} s, "
                             "--hang-timeout-s): ending this decode actor's process, so the job counts a crash "
                             "and goes on without it")


def end_process(reason: str) -> None:
    print(f"specbatch: hang watchdog: {reason}", file=sys.stderr, flush=True)
    os._exit(1)
