"""The linear candidates `specbatch kernels` times: each computes the linear, the ones marked row-invariant are, and
the command prints a row per shape and row count."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core import cli
from specdec_core.kernels import coded_panels, linear_plan


def _usable(dtype):
    return [c for c in linear_plan.CANDIDATES if dtype in c.dtypes and c.usable()]


def _weight(candidate, out_features: int, in_features: int, dtype, generator) -> torch.Tensor:
    """A random weight the candidate takes: block codes 32 inputs wide for the coded one, any other width else."""
    if candidate.coded:
        in_features = -(-in_features // coded_panels.BLOCK) * coded_panels.BLOCK
        return coded_panels.round_to_codes(torch.randn(out_features, in_features, generator=generator) * 0.05)
    return (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_usable_candidate_computes_the_linear(dtype):
    generator = torch.Generator().manual_seed(3)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert _usable(dtype), "no candidate runs here"
    for candidate in _usable(dtype):
        weight = _weight(candidate, 40, 70, dtype, generator)  # widths that fill no panel exactly
        x = torch.randn(9, weight.shape[1], generator=generator).to(dtype)
        expected = F.linear(x.float(), weight.float())
        got = candidate.build(weight)(x)
        assert got.dtype == dtype and got.shape == (9, 40), candidate.name
        assert torch.allclose(got.float(), expected, atol=tolerance, rtol=tolerance), candidate.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_candidates_marked_row_invariant_give_a_row_the_same_bits_in_any_batch(dtype):
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(33, 96, generator=generator).to(dtype)
    for candidate in (c for c in _usable(dtype) if c.row_invariant):
        run = candidate.build(_weight(candidate, 48, 96, dtype, generator))
        together = run(x)
        for row in (0, 5, 32):
            assert torch.equal(run(x[row:row + 1])[0], together[row]), (candidate.name, row)


def test_fastest_keeps_to_row_invariant_candidates_when_deterministic():
    timings = [linear_plan.Timing("o", 8, 8, 16, "onednn", False, 300.0),
               linear_plan.Timing("o", 8, 8, 16, "bf16_dot", True, 150.0),
               linear_plan.Timing("o", 8, 8, 16, "panel", True, 90.0)]
    assert linear_plan.fastest(timings, False)[("o", 16)].candidate == "onednn"
    assert linear_plan.fastest(timings, True)[("o", 16)].candidate == "bf16_dot"


def test_the_kernels_command_prints_each_shape_and_row_count(capsys):
    assert cli.main(["kernels", "--rows", "1", "3", "--seconds", "0.001", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "float32" in out and "threads" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| shape")]
    assert len(rows) == 4 * 2  # qkv, o, gate_up, down x 2 row counts
    assert all(line.split(" | ")[-2] and line.split(" | ")[-1].strip(" |") != "-" for line in rows)


def test_the_kernels_command_refuses_bad_row_counts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["kernels", "--rows", "0"])
    assert exit_info.value.code == 2
    assert "--rows must be >= 1" in capsys.readouterr().err


def test_decode_sized_row_counts_are_timed_over_weights_that_overflow_the_cache(monkeypatch):
    """Up to STREAMED_ROWS rows a kernel is memory-bound in a real forward (every layer's weights stream through): it
    is timed over distinct copies of the weight, twice the last-level cache in all; larger counts over one."""
    built, ran = [], []

    def build(weight):
        built.append(weight.data_ptr())
        return lambda x: ran.append((x.shape[0], weight.data_ptr())) or x @ weight.T

    fake = linear_plan.Candidate("fake", True, (torch.float32,), lambda: True, build)
    monkeypatch.setattr(linear_plan, "CANDIDATES", (fake,))
    monkeypatch.setattr(linear_plan, "last_level_cache_bytes", lambda: 40 * 70 * 4 * 3)  # 3 weights' worth
    timings = linear_plan.measure({"o": (40, 70)}, [4, linear_plan.STREAMED_ROWS + 1], torch.float32, 0.001)
    assert len(timings) == 2 and len(set(built)) == 6  # 2 x the cache: 6 distinct copies
    assert {ptr for rows, ptr in ran if rows == 4} == set(built)
    assert {ptr for rows, ptr in ran if rows > linear_plan.STREAMED_ROWS} == {built[0]}
    assert fake.layout_bytes(torch.bfloat16) == 2 and linear_plan.CANDIDATES[0].layout_bytes(torch.float32) == 4


def test_candidates_are_timed_in_rounds_against_the_reference(monkeypatch):
    """Every candidate runs once per round, in an order that rotates, at least ROUNDS rounds; `paired` is the median
    of the reference's time over the candidate's in the same round: exactly 1 for the reference itself, and for a
    kernel doing twice the reference's work, about 0.5."""
    order = []

    def build(repeats, name):
        return lambda weight: lambda x: order.append(name) or [x @ weight.T for _ in range(repeats)][-1]

    fakes = tuple(linear_plan.Candidate(name, True, (torch.float32,), lambda: True, build(repeats, name))
                  for name, repeats in (("one", 20), ("two", 40)))
    monkeypatch.setattr(linear_plan, "CANDIDATES", fakes)
    monkeypatch.setattr(linear_plan, "last_level_cache_bytes", lambda: 1)  # one copy each
    timings = linear_plan.measure({"o": (64, 64)}, [128], torch.float32, 0.0, reference="one")
    by_name = {t.candidate: t for t in timings}
    assert by_name["one"].paired == 1.0 and 0.3 < by_name["two"].paired < 0.8
    timed = order[2:]  # after one untimed call each
    assert len(timed) >= 2 * linear_plan.ROUNDS and timed[:4] == ["one", "two", "two", "one"]
    assert linear_plan.measure({"o": (64, 64)}, [128], torch.float32, 0.0)[0].paired is None  # no reference
