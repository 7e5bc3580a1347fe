"""The decode actors' hang watchdog (operators/hang_watchdog.py): it ends the process when no forward finishes for
too long, never while forwards keep finishing; the end-to-end case (a hung row in a Ray job) is in
tests/pipelines/test_cluster_submit.py."""

import threading
import time
from types import SimpleNamespace

from operators.hang_watchdog import HANG_FLOOR_S, HANG_STEP_MULTIPLE, HangWatchdog, default_limit


def _decoder(slowest: float = 0.0):
    return SimpleNamespace(last_progress=time.monotonic(), slowest_forward_s=slowest)


def test_a_decoder_that_finishes_no_forward_for_the_limit_is_ended_once():
    reasons, ended = [], threading.Event()
    watchdog = HangWatchdog(timeout_s=0.3, on_hang=lambda reason: (reasons.append(reason), ended.set()), poll_s=0.05)
    with watchdog.watching(_decoder()):
        assert ended.wait(5.0)
        time.sleep(0.3)
    assert len(reasons) == 1 and "no forward finished for" in reasons[0] and "0 s" in reasons[0]
    assert watchdog.fired


def test_forwards_that_keep_finishing_are_never_ended_nor_is_an_idle_actor():
    reasons = []
    watchdog = HangWatchdog(timeout_s=0.3, on_hang=reasons.append, poll_s=0.05)
    decoder = _decoder()
    with watchdog.watching(decoder):
        for _ in range(20):  # 1 s of steps, each well inside the limit
            time.sleep(0.05)
            decoder.last_progress = time.monotonic()
    time.sleep(0.6)  # between passes (no decoder watched) nothing is timed
    assert reasons == [] and not watchdog.fired


def test_the_default_limit_follows_the_slowest_forward_of_any_pass_with_a_floor():
    assert default_limit(0.0) == HANG_FLOOR_S
    assert default_limit(60.0) == HANG_STEP_MULTIPLE * 60.0
    watchdog = HangWatchdog(on_hang=lambda reason: None, poll_s=10.0)
    with watchdog.watching(_decoder(slowest=40.0)):
        pass
    assert watchdog.limit(_decoder(slowest=1.0)) == HANG_STEP_MULTIPLE * 40.0  # an earlier pass's slowest counts
    assert HangWatchdog(timeout_s=7.0, on_hang=lambda reason: None, poll_s=10.0).limit(_decoder(100.0)) == 7.0


def test_the_decoder_reports_progress_after_each_forward():
    from specdec_core.drafters.base import NoDrafter
    from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
    from specdec_core.loop.requests import DecodeParams
    from tests.tiny_models import repetitive_prompt, tiny_llama

    decoder = BatchDecoder(tiny_llama(), max_batch=2)
    created = decoder.last_progress
    for key in range(2):
        decoder.submit(DecodeRequest(key, repetitive_prompt(key, 20), DecodeParams(max_new_tokens=4), NoDrafter()))
    decoder.admit()
    after_prefill = decoder.last_progress
    assert after_prefill > created and decoder.slowest_forward_s > 0
    decoder.step()
    assert decoder.last_progress > after_prefill
