"""The invariant CPU attention of --deterministic (invariant_attention.py): each row's chain attention equals fp32
SDPA over that row's keys, and a token's result is the same bits whatever batch or forward it comes in."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core.kernels import invariant_attention

CACHES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-cache"])


@pytest.fixture(autouse=True)
def compiled():
    if invariant_attention.kernel() is None:
        pytest.skip(f"no compiled invariant attention here: {invariant_attention.kernel.unavailable}")


def chains(news, num_new):
    """news [b] chain lengths -> visible [b, T, T]: token t < news[r] sees new tokens 0..t, the padding nothing."""
    visible = torch.zeros(len(news), num_new, num_new, dtype=torch.bool)
    for r, new in enumerate(news):
        visible[r, :new, :new] = torch.ones(new, new, dtype=torch.bool).tril()
    return visible


def batch(dtype):
    """Three rows at cache slots 4, 0, 2 with 0, 57 and 100 cached keys and chains of QUERY_BLOCK + 9, 30 and 1 new
    tokens (the first crosses a query block, the second has padding after it); 6 query heads on 2 key/value heads,
    head_dim 32; fp32 queries. The cache past each row's keys, and the slots no row uses, hold NaN: never read."""
    torch.manual_seed(0)
    heads, kv_heads, dim, capacity = 6, 2, 32, 180
    num_new = invariant_attention.QUERY_BLOCK + 9
    slots, lengths, news = torch.tensor([4, 0, 2]), torch.tensor([0, 57, 100]), [num_new, 30, 1]
    keys = torch.full((5, kv_heads, capacity, dim), float("nan"))  # [slots, KV, capacity, d]
    values = keys.clone()
    for slot, length, new in zip(slots.tolist(), lengths.tolist(), news):
        keys[slot, :, :length + new] = torch.randn(kv_heads, length + new, dim) * 2
        values[slot, :, :length + new] = torch.randn(kv_heads, length + new, dim)
    query = torch.randn(3, heads, num_new, dim) * 2  # [b, H, T, d]
    return query, keys.to(dtype), values.to(dtype), slots, lengths, chains(news, num_new)


def reference(query, keys, values, slot, length, new, scale):
    """One row's chain attention in fp32 through SDPA: query [H, T, d] -> [new, H, d] (new tokens only)."""
    n = length + new
    mask = torch.ones(new, n, dtype=torch.bool).tril(length)  # [new, n]: the cached keys, the chain up to itself
    out = F.scaled_dot_product_attention(query[None, :, :new].float(), keys[slot, :, :n][None].float(),
                                         values[slot, :, :n][None].float(), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@CACHES
def test_each_rows_chain_equals_fp32_sdpa(dtype):
    """Rows at other cache slots with other cached lengths, a chain crossing QUERY_BLOCK, grouped query heads: each
    row equals fp32 SDPA over its own keys within 1e-5 (bf16 caches widened exactly); the padding gets zeros."""
    query, keys, values, slots, lengths, visible = batch(dtype)
    b, heads, num_new, dim = query.shape
    scale = dim ** -0.5
    out = invariant_attention.attend(query, keys, values, slots, lengths, visible, scale)  # [b, T, H, d]
    assert out.shape == (b, num_new, heads, dim) and out.dtype == torch.float32
    for r in range(b):
        new = int(visible[r].diagonal().sum())
        want = reference(query[r], keys, values, int(slots[r]), int(lengths[r]), new, scale)
        assert (out[r, :new] - want).abs().max() < 1e-5, r
        assert not out[r, new:].any()  # the padding


@CACHES
def test_a_tokens_result_does_not_depend_on_its_batch_or_forward(dtype):
    """The module's guarantee, bitwise: each row alone, each chain fed in two chunks (its tokens in other query
    blocks) and each token fed alone at its position (a decode step) give the batch's bits."""
    query, keys, values, slots, lengths, visible = batch(dtype)
    scale = query.shape[-1] ** -0.5
    out = invariant_attention.attend(query, keys, values, slots, lengths, visible, scale)  # [b, T, H, d]

    def fed(r, first, last):
        """Row r's new tokens first..last - 1 in one forward of their own, after the keys before them -> [T', H, d]."""
        count = last - first
        chain = torch.ones(1, count, count, dtype=torch.bool).tril()  # [1, T', T']
        return invariant_attention.attend(query[r:r + 1, :, first:last], keys, values, slots[r:r + 1],
                                          lengths[r:r + 1] + first, chain, scale)[0]

    for r in range(len(slots)):
        new = int(visible[r].diagonal().sum())
        assert torch.equal(fed(r, 0, new), out[r, :new]), r
        if new > 1:
            cut = new // 3
            assert torch.equal(torch.cat([fed(r, 0, cut), fed(r, cut, new)]), out[r, :new]), r
        for t in range(new):
            assert torch.equal(fed(r, t, t + 1)[0], out[r, t]), (r, t)
