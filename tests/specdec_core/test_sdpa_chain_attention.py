"""Prompt chains through SDPA row by row (sdpa_chain_attention.py): each row's chain over its own keys within bf16's
rounding of an fp32 reference, and a bf16 runner whose kernel plan picked it sends its prefill chunks there (not
with --deterministic)."""

import pytest
import torch

from specdec_core.kernels import bf16_attention, chain_plan, sdpa_chain_attention
from specdec_core.kernels.kernel_plan import KernelPlan
from specdec_core.model import grouped_attention
from tests.specdec_core.test_bf16_attention import nan_padded_chains, reference
from tests.specdec_core.test_deterministic import feed, runner_in


def test_each_rows_chain_attends_its_own_keys_within_bf16_rounding():
    """Rows at other cache slots, prompts from position 0 and chunks over cached keys, chains of other lengths, a
    row with no new token, NaN past every row's keys (never read): the padding stays zero."""
    torch.manual_seed(0)
    heads, kv_heads, dim, capacity = 6, 2, 32, 160
    num_new = 40
    slots, lengths, news = torch.tensor([4, 0, 2, 1]), torch.tensor([0, 57, 100, 3]), torch.tensor([num_new, 30, 1, 0])
    query, keys, values = nan_padded_chains(heads, kv_heads, dim, capacity, slots, lengths, news)  # [b, H, T, d]
    out = sdpa_chain_attention.attend(query, keys, values, slots, lengths, news, dim ** -0.5)  # [b, T, H, d]
    assert out.shape == (4, num_new, heads, dim) and out.dtype == torch.bfloat16
    for r in range(3):
        want = reference(query[r], keys, values, int(slots[r]), int(lengths[r]), int(news[r]))
        assert (out[r, :news[r]].float() - want).abs().max() < 3e-2, r
        assert not out[r, news[r]:].any()  # the padding
    assert not out[3].any()


@pytest.mark.skipif(not bf16_attention.available(), reason="prompt chains need the bf16 chain path on this CPU")
def test_a_runner_whose_plan_picked_sdpa_prefills_through_it_but_not_with_deterministic(monkeypatch):
    runner = runner_in(torch.bfloat16)
    runner.deterministic = False
    prefill = grouped_attention.MAX_QUERIES + 24
    pieces = [prefill, 3, 1]
    ours = feed(runner, pieces)
    assert runner.unmasked_prefill and runner.prefill_rows_apart  # bf16_attention: no mask anywhere
    runner.kernel_plan = KernelPlan("test", "panel", {}, (), 0.0, 0, prompt_attention="sdpa",
                                    attention_ms={"bf16_attention": 5.0, "sdpa": 2.0})
    assert not runner.unmasked_prefill and runner.prefill_rows_apart  # SDPA masks a row with cached keys
    calls = []
    real_attend = sdpa_chain_attention.attend
    monkeypatch.setattr(sdpa_chain_attention, "attend", lambda *args: calls.append(args[0].shape[2]) or real_attend(*args))
    theirs = feed(runner, pieces)
    assert calls == [prefill] * runner.num_layers  # the prefill chunk only: the steps keep their own kernels
    assert torch.allclose(ours, theirs, atol=0.1), (ours - theirs).abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
    runner.deterministic = True
    calls.clear()
    feed(runner, pieces, prefill=True)
    assert not calls and chain_plan.kernel("sdpa") is sdpa_chain_attention
