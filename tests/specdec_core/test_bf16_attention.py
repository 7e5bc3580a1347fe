"""The bf16 dot-product attention of long bf16 forwards (bf16_attention.py): the attention of each row's chain, within
bf16's rounding of an fp32 reference, and what the model runner sends to it."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core.model import grouped_attention
from specdec_core.kernels import bf16_attention, bf16_dot
from tests.specdec_core.test_deterministic import feed, runner_in

pytestmark = pytest.mark.skipif(not bf16_dot.available(), reason="no AVX512_BF16 dot-product kernel on this CPU")


def reference(query, keys, values, slot, length, new):
    """One row's chain attention in fp32 through SDPA: query [H, T, d] -> [T, H, d] (new tokens only)."""
    n = length + new
    mask = torch.ones(new, n, dtype=torch.bool).tril(length)
    out = F.scaled_dot_product_attention(query[None, :, :new].float(), keys[slot, :, :n][None].float(),
                                         values[slot, :, :n][None].float(), attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # [new, H, d]


def nan_padded_chains(heads: int, kv_heads: int, dim: int, capacity: int, slots, lengths, news):
    """Random bf16 chains: query [b, H, max news, d] and the whole key/value buffers [5, KV, capacity, d], each row's
    cached and new keys at its slot, NaN everywhere else (a kernel that reads past a row's keys returns NaN)."""
    keys = torch.full((5, kv_heads, capacity, dim), float("nan")).to(torch.bfloat16)
    values = keys.clone()
    for slot, length, new in zip(slots.tolist(), lengths.tolist(), news.tolist()):
        keys[slot, :, :length + new] = (torch.randn(kv_heads, length + new, dim) * 2).to(torch.bfloat16)
        values[slot, :, :length + new] = torch.randn(kv_heads, length + new, dim).to(torch.bfloat16)
    query = (torch.randn(len(slots), heads, int(news.max()), dim) * 2).to(torch.bfloat16)
    return query, keys, values


@pytest.mark.parametrize("dim", [16, 64])
def test_each_rows_chain_attends_its_own_keys_within_bf16_rounding(dim):
    """Rows at other cache slots, with cached prefixes of other lengths, chains of other lengths (the padding after
    a row's chain gets zeros), a query block boundary crossed, an odd key count: each row equals the fp32 reference
    within bf16 rounding (SDPA in bf16 errs about 3x more on the same inputs)."""
    torch.manual_seed(0)
    heads, kv_heads, capacity = 6, 2, 160  # head_dim 16: fewer dimensions than two panels of the kernel
    keys = (torch.randn(5, kv_heads, capacity, dim) * 2).to(torch.bfloat16)
    values = torch.randn(5, kv_heads, capacity, dim).to(torch.bfloat16)
    num_new = bf16_attention.QUERY_BLOCK + 9
    query = (torch.randn(3, heads, num_new, dim) * 2).to(torch.bfloat16)
    slots, lengths, news = torch.tensor([4, 0, 2]), torch.tensor([0, 57, 100]), torch.tensor([num_new, 30, 1])
    out = bf16_attention.attend(query, keys, values, slots, lengths, news, dim ** -0.5)
    assert out.shape == (3, num_new, heads, dim) and out.dtype == torch.bfloat16
    for r in range(3):
        want = reference(query[r], keys, values, int(slots[r]), int(lengths[r]), int(news[r]))
        got = out[r, :news[r]].float()
        assert (got - want).abs().max() < 2e-2, r
        assert not out[r, news[r]:].any()  # the padding


def test_only_chains_are_taken():
    chain = torch.zeros(2, 4, 4, dtype=torch.bool)
    chain[0] = torch.ones(4, 4, dtype=torch.bool).tril()
    chain[1, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    assert bf16_attention.chain_news(chain).tolist() == [4, 2]
    tree = chain.clone()
    tree[0, 2, 1] = False  # node 2 a sibling of node 1, not its child
    assert bf16_attention.chain_news(tree) is None


def test_a_bf16_prefill_attends_through_it_and_gives_the_sdpa_logits(monkeypatch):
    """The model runner sends a bf16 forward of more than MAX_QUERIES tokens a row (a prefill chunk) here and
    decode steps elsewhere; the logits of every position stay those of the SDPA path within bf16 rounding."""
    runner = runner_in(torch.bfloat16)
    runner.deterministic = False
    prefill = grouped_attention.MAX_QUERIES + 24
    pieces = [prefill, 3, 1]
    calls = []
    real_attend = bf16_attention.attend
    monkeypatch.setattr(bf16_attention, "attend", lambda *args: calls.append(args[0].shape[2]) or real_attend(*args))
    ours = feed(runner, pieces)
    assert calls == [prefill] * runner.num_layers
    monkeypatch.setattr(bf16_attention, "usable", lambda head_dim: False)
    calls.clear()
    theirs = feed(runner, pieces)
    assert not calls
    assert ours.shape == theirs.shape == (sum(pieces), runner.vocab_size)
    assert torch.allclose(ours, theirs, atol=0.1), (ours - theirs).abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_head_dim_128_rows_attend_their_own_keys_within_bf16_rounding():
    """head_dim 128 (Llama-family heads: 8 value panels, against 2 at 16 and 4 at 64): rows at other cache slots with
    other cached lengths, a chain crossing two query blocks, an odd key count, 4 query heads a key/value head: each
    row equals the fp32 reference within bf16 rounding, the padding gets zeros, the NaN past its keys is not read."""
    torch.manual_seed(0)
    heads, kv_heads, dim, capacity = 8, 2, 128, 180
    num_new = 2 * bf16_attention.QUERY_BLOCK + 5
    slots, lengths, news = torch.tensor([4, 0, 2]), torch.tensor([0, 57, 100]), torch.tensor([num_new, 30, 1])
    query, keys, values = nan_padded_chains(heads, kv_heads, dim, capacity, slots, lengths, news)
    out = bf16_attention.attend(query, keys, values, slots, lengths, news, dim ** -0.5)  # [b, T, H, d]
    assert out.shape == (3, num_new, heads, dim) and out.dtype == torch.bfloat16
    for r in range(3):
        want = reference(query[r], keys, values, int(slots[r]), int(lengths[r]), int(news[r]))
        assert (out[r, :news[r]].float() - want).abs().max() < 2e-2, r
        assert not out[r, news[r]:].any()  # the padding
