"""Faults for the cluster test, installed in every Ray worker of its job by the runtime environment's
`worker_process_setup_hook` (the only way into a submitted job's actors): the row whose id POISON_ENV names kills
its worker process each time it is submitted to a decoder (as a native crash or an out-of-memory kill would); the
row HANG_ENV names never returns (as a deadlocked forward would). Production code carries no hook for them."""

import os
import time

POISON_ENV = "SPECBATCH_TEST_CRASH_ON_ROW"
HANG_ENV = "SPECBATCH_TEST_HANG_ON_ROW"
SETUP_HOOK = f"{__name__}.install"


def install() -> None:
    from operators import decode_requests

    submit = decode_requests._MethodPass.submit

    def submit_or_fault(self, turn):
        row_id = str(turn.row.get("id"))
        if os.environ.get(POISON_ENV) == row_id:
            os._exit(1)
        if os.environ.get(HANG_ENV) == row_id:
            while True:
                time.sleep(60)
        submit(self, turn)

    decode_requests._MethodPass.submit = submit_or_fault
