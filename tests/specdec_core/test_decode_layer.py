"""decode_layer.py: a bf16 step's layers as one compiled call each give the layer-by-layer path's logits bit for
bit, in ragged steps beside other rows, with and without --deterministic."""

import pytest
import torch

from specdec_core.kernels import bf16_dot, decode_layer
from tests.specdec_core.test_deterministic import feed, runner_in
from tests.tiny_models import tiny_llama, tiny_llama_64

needs_bf16_dot = pytest.mark.skipif(not bf16_dot.available(), reason="no AVX512_BF16 here: the kernel does not run")


@needs_bf16_dot
@pytest.mark.parametrize("deterministic", [True, False], ids=["exact", "step"])
def test_a_steps_layers_in_one_call_give_the_layer_by_layer_logits_bit_for_bit(deterministic, monkeypatch):
    runner = runner_in(torch.bfloat16, tiny_llama_64)
    runner.deterministic = deterministic
    calls = []
    real = decode_layer.run_layers
    monkeypatch.setattr(decode_layer, "run_layers", lambda *args: calls.append(args[3]) or real(*args))
    pieces = [4, 1, 3, 1, 5, 2, 1]  # each forward also feeds 1-4 tokens to two rows of other lengths: ragged
    fused = feed(runner, pieces, others=[7, 20])
    count = len(calls)
    assert count >= len(pieces)  # every step of row 0 (and the neighbours' first forwards where they are steps)
    assert any(flat is not None for flat in calls), "no step had padding: the ragged gather went untested"
    monkeypatch.setattr(decode_layer, "usable", lambda *args: False)
    layered = feed(runner, pieces, others=[7, 20])
    assert len(calls) == count
    assert torch.equal(fused, layered), (fused - layered).abs().max()


@needs_bf16_dot
def test_only_bf16_panel_models_are_packed_and_steps_without_the_bf16_step_kernel_keep_the_layers(monkeypatch):
    """fp32 linears are not packed and a bf16 model's pair panels are; a bf16 model whose head_dim the step kernel does
    not take (tiny_llama: 32) never sends a forward here."""
    assert runner_in(torch.float32, tiny_llama_64).fast.fused is None
    assert runner_in(torch.bfloat16, tiny_llama_64).fast.fused is not None
    calls = []
    real = decode_layer.run_layers
    monkeypatch.setattr(decode_layer, "run_layers", lambda *args: calls.append(1) or real(*args))
    logits = feed(runner_in(torch.bfloat16, tiny_llama), [4, 1, 3, 1])
    assert calls == [] and torch.isfinite(logits).all()


def recording(runner, layers: set[int], heads: dict[int, list[int]]) -> list:
    """Make every forward of `runner` record `layers`' outputs and `heads`' queries (what PLD+ (h) and (a) read)
    -> the list each forward's (captured, queries) is appended to."""
    real, records = runner.forward_slots, []

    def forward(cache, batch, *args):
        batch.captured = {layer: None for layer in layers}
        batch.query_heads = dict(heads)
        logits = real(cache, batch, *args)
        records.append((dict(batch.captured), dict(batch.queries)))
        return logits

    runner.forward_slots = forward
    return records


@needs_bf16_dot
@pytest.mark.parametrize("layers,heads,calls_of", [({1}, {}, {1}), (set(), {1: [0, 3]}, {2}), ({0, 2}, {0: [2]}, {2})],
                         ids=["hidden-states", "queries-last-layer", "both-first-layer"])
def test_a_step_that_records_layers_runs_them_in_one_call_each_and_records_the_same_bits(layers, heads, calls_of,
                                                                                          monkeypatch):
    """A layer's output (PLD+ (h)) splits the compiled calls around it (calls of 1 layer of the 2); queries (PLD+
    (a)) and the embeddings and last layer's output do not (calls of 2)."""
    calls = []
    real = decode_layer.run_layers
    monkeypatch.setattr(decode_layer, "run_layers", lambda *args: calls.append(len(args[0])) or real(*args))
    pieces = [4, 1, 3, 1, 5, 2, 1]
    runner = runner_in(torch.bfloat16, tiny_llama_64)
    records = recording(runner, layers, heads)
    fused = feed(runner, pieces, others=[7, 20])
    assert len(calls) >= len(pieces) and set(calls) == calls_of
    monkeypatch.setattr(decode_layer, "usable", lambda *args: False)
    runner = runner_in(torch.bfloat16, tiny_llama_64)
    layered_records = recording(runner, layers, heads)
    layered = feed(runner, pieces, others=[7, 20])
    assert torch.equal(fused, layered), (fused - layered).abs().max()
    assert len(records) == len(layered_records)
    for (captured, queries), (captured_layered, queries_layered) in zip(records, layered_records):
        assert captured.keys() == layers and queries.keys() == heads.keys()
        for layer in layers:
            assert torch.equal(captured[layer], captured_layered[layer])
        for layer in heads:
            assert torch.equal(queries[layer], queries_layered[layer])
