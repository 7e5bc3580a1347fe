"""The pass split's forward timer: each forward counted under its kind, and the fast forward's own run put back."""

from types import SimpleNamespace

import torch

from benchmarks.pass_split import ForwardTimer, split_line
from specdec_core.model import fast_forward


def test_forwards_are_counted_by_width_and_the_run_is_restored(monkeypatch):
    seen = []
    monkeypatch.setattr(fast_forward.FastForward, "run",
                        lambda forward, cache, batch, attention, real: seen.append(batch.input_ids.shape) or "out")
    original = fast_forward.FastForward.run
    with ForwardTimer() as timer:
        for width in (1, 1, 4, 16, 17, 300):
            batch = SimpleNamespace(input_ids=torch.zeros(2, width, dtype=torch.long))
            assert fast_forward.FastForward.run(None, None, batch, None, None) == "out"
    assert fast_forward.FastForward.run is original
    assert len(seen) == 6
    assert dict(timer.calls) == {"T=1": 2, "T=4": 1, "T=16": 1, "prefill": 2}
    line = split_line("ar", 10.0, 100, timer)
    assert line.startswith("| ar | 10.0 | 10.00 |") and "T=1 2 x" in line and "T=16 1 x" in line


def test_a_failing_forward_is_still_timed_and_raises(monkeypatch):
    def failing(forward, cache, batch, attention, real):
        raise RuntimeError("boom")

    monkeypatch.setattr(fast_forward.FastForward, "run", failing)
    with ForwardTimer() as timer:
        try:
            fast_forward.FastForward.run(None, None, SimpleNamespace(input_ids=torch.zeros(1, 1)), None, None)
        except RuntimeError as exc:
            assert str(exc) == "boom"
        else:
            raise AssertionError("the forward's error was swallowed")
    assert timer.calls["T=1"] == 1
