"""The pass split's forward timer: each forward counted under its kind (a prefill forward by where it runs, a step
by its width), the steps kept for their detail, and the fast forward's and the decoder's own methods put back."""

from types import SimpleNamespace

import torch

from benchmarks.pass_split import ForwardTimer, split_line, step_details
from specdec_core.loop.batch_decode import BatchDecoder
from specdec_core.model import fast_forward


def batch_of(rows: int, width: int) -> SimpleNamespace:
    """A step's batch whose rows have one real token each (their first sees itself)."""
    visible = torch.zeros(rows, width, width, dtype=torch.bool)
    visible[:, 0, 0] = True
    return SimpleNamespace(input_ids=torch.zeros(rows, width, dtype=torch.long), visible=visible)


def test_forwards_are_counted_by_kind_and_the_methods_are_restored(monkeypatch):
    seen = []
    monkeypatch.setattr(fast_forward.FastForward, "run",
                        lambda forward, cache, batch, attention, real: seen.append(batch.input_ids.shape) or "out")
    monkeypatch.setattr(BatchDecoder, "_prefill_forward",
                        lambda decoder, group, chunks: fast_forward.FastForward.run(None, None, batch_of(2, 4), None,
                                                                                    None))
    run, prefill = fast_forward.FastForward.run, BatchDecoder._prefill_forward
    with ForwardTimer() as timer:
        for width in (1, 1, 4, 17):  # a suffix tree's verify may be wider than a short prompt's prefill
            assert fast_forward.FastForward.run(None, None, batch_of(2, width), None, None) == "out"
        assert BatchDecoder._prefill_forward(None, [], []) == "out"
    assert fast_forward.FastForward.run is run and BatchDecoder._prefill_forward is prefill
    assert len(seen) == 5
    assert dict(timer.calls) == {"T=1": 2, "T=4": 1, "T=17": 1, "prefill": 1}
    assert [(rows, width, real) for rows, width, real, _ in timer.steps] == [(2, 1, 2), (2, 1, 2), (2, 4, 2),
                                                                             (2, 17, 2)]
    line = split_line("ar", 10.0, 100, timer)
    assert line.startswith("| ar | 10.0 | 10.00 |") and "T=1 2 x" in line and "T=17 1 x" in line


def test_a_failing_forward_is_still_timed_and_raises(monkeypatch):
    def failing(forward, cache, batch, attention, real):
        raise RuntimeError("boom")

    monkeypatch.setattr(fast_forward.FastForward, "run", failing)
    with ForwardTimer() as timer:
        try:
            fast_forward.FastForward.run(None, None, batch_of(1, 1), None, None)
        except RuntimeError as exc:
            assert str(exc) == "boom"
        else:
            raise AssertionError("the forward's error was swallowed")
    assert timer.calls["T=1"] == 1


def test_step_details_price_one_more_row_and_one_more_verified_token():
    """Plain steps of 10 rows at 17 ms and of 16 at 20 ms; a 16-row step verifying 12 draft tokens in 32 ms: one
    more verified token cost (32 - 20) / 12 = 1 ms."""
    steps = [(10, 1, 10, 0.017)] * 3 + [(16, 1, 16, 0.020)] * 4 + [(16, 3, 28, 0.032)]
    text = step_details("suffix", steps, batch_size=16)
    assert "10: 17.0 (3), 16: 20.0 (4)" in text
    assert "by real tokens: 24+: 32.0 (1)" in text
    assert "one more verified token by rows, ms: 16: 1.00 (1)" in text
