"""The bf16 dot-product attention of decode and verify steps (bf16_step_attention.py): each row's attention over
its cached keys and the new tokens it may see, within bf16 rounding of an fp32 reference."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core.kernels import bf16_step_attention
from specdec_core.loop.draft_tree import ancestor_mask

pytestmark = pytest.mark.skipif(not bf16_step_attention.usable(64), reason="no AVX512_BF16 dot-product kernel here")


def reference(query, keys, values, slot, length, visible):
    """One row in fp32 through SDPA: query [H, T, d], visible [T, T] -> [T, H, d] (the tokens that see themselves)."""
    real = int(visible.diagonal().sum())
    mask = torch.cat([torch.ones(real, length, dtype=torch.bool), visible[:real, :real]], dim=1)
    out = F.scaled_dot_product_attention(query[None, :, :real].float(), keys[slot, :, :length + real][None].float(),
                                         values[slot, :, :length + real][None].float(), attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (128, 4, 2)])
def test_decode_and_verify_rows_attend_their_own_keys_within_bf16_rounding(dim, heads, kv_heads):
    """Rows at other cache slots with other cached lengths (odd and even), a chain, a tree (node 2 a sibling of node
    1) and padding after a row's real tokens: each equals the fp32 reference within bf16 rounding; padding is zero.
    The cache past each row's keys holds NaN, which must never be read."""
    torch.manual_seed(0)
    capacity, num_new = 120, 4
    keys = torch.full((4, kv_heads, capacity, dim), float("nan")).to(torch.bfloat16)
    values = keys.clone()
    lengths = torch.tensor([37, 0, 100, 8])
    slots = torch.tensor([3, 1, 0, 2])
    visible = torch.zeros(4, num_new, num_new, dtype=torch.bool)
    visible[0] = torch.ones(num_new, num_new, dtype=torch.bool).tril()  # a chain of 4
    visible[1, :1, :1] = True  # one token (a decode step), padding after it
    visible[2, :3, :3] = ancestor_mask([-1, -1], 3)  # a tree: the root's two children
    visible[3, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    for r in range(4):
        real = int(visible[r].diagonal().sum())
        keys[slots[r], :, :lengths[r] + real] = (torch.randn(kv_heads, int(lengths[r]) + real, dim) * 2).bfloat16()
        values[slots[r], :, :lengths[r] + real] = torch.randn(kv_heads, int(lengths[r]) + real, dim).bfloat16()
    query = (torch.randn(4, heads, num_new, dim) * 2).to(torch.bfloat16)
    out = bf16_step_attention.attend(query, keys, values, slots, lengths, visible, dim ** -0.5)
    assert out.shape == (4, num_new, heads, dim) and out.dtype == torch.bfloat16
    for r in range(4):
        real = int(visible[r].diagonal().sum())
        want = reference(query[r], keys, values, int(slots[r]), int(lengths[r]), visible[r])
        assert (out[r, :real].float() - want).abs().max() < 2e-2, r
        assert not out[r, real:].any()


def test_real_tokens_that_are_not_a_rows_first_are_left_to_the_other_kernel():
    visible = torch.zeros(2, 3, 3, dtype=torch.bool)
    visible[0, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    assert bf16_step_attention.takes(visible)
    visible[1, 1, 1] = True  # row 1: token 0 padding, token 1 real
    assert not bf16_step_attention.takes(visible)
    query = torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="real tokens first"):
        bf16_step_attention.attend(query, cache, cache, torch.tensor([0, 1]), torch.tensor([2, 2]), visible, 0.1)


def test_bf16_steps_attend_through_it_and_give_the_fp32_kernels_logits(monkeypatch):
    """Without --deterministic the model runner sends a bf16 step of at most MAX_QUERIES tokens a row here (a model
    with head_dim 64); its logits stay those of invariant_attention.py's fp32 arithmetic within bf16 rounding."""
    from specdec_core.model import grouped_attention
    from specdec_core.kernels import decode_layer, invariant_attention
    from tests.specdec_core.test_deterministic import SEQUENCE, feed, runner_in
    from tests.tiny_models import tiny_llama_64

    runner = runner_in(torch.bfloat16, tiny_llama_64)
    runner.deterministic = False
    # layer by layer: the steps' one compiled call a layer runs the same kernel (test_decode_layer.py)
    monkeypatch.setattr(decode_layer, "usable", lambda *args: False)
    prefill = grouped_attention.MAX_QUERIES + 4
    pieces = [prefill, 5, 3] + [1] * (len(SEQUENCE) - prefill - 8)
    calls = {"step": 0, "invariant": 0}
    def counted(real, name):
        def attend(*args):
            calls[name] += 1
            return real(*args)
        return attend

    for owner, name in ((bf16_step_attention.Step, "step"), (invariant_attention, "invariant")):
        monkeypatch.setattr(owner, "attend", counted(owner.attend, name))
    ours = feed(runner, pieces)
    assert calls == {"step": runner.num_layers * (len(pieces) - 1), "invariant": 0}
    monkeypatch.setattr(bf16_step_attention, "usable", lambda head_dim: False)
    theirs = feed(runner, pieces)
    assert calls["invariant"] == runner.num_layers * (len(pieces) - 1)
    assert torch.allclose(ours, theirs, atol=0.1), (ours - theirs).abs().max()


@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (128, 4, 2)])
def test_the_exact_kernel_gives_a_verified_or_tree_token_the_numbers_of_the_token_fed_alone(dim, heads, kv_heads):
    """attend_exact (--deterministic): each token of a 5-token chain and of a tree (root; a, b under it; a2 under a)
    over 37 cached keys equals, bit for bit, the same query fed alone after its own path (cached keys, then its
    ancestors in depth order); odd and even cached lengths; a neighbour row of another width beside it."""
    torch.manual_seed(7)
    for length in (37, 38):
        keys = (torch.randn(8, kv_heads, 64, dim) * 2).bfloat16()
        values = torch.randn(8, kv_heads, 64, dim).bfloat16()
        parents = [-1, -1, 0]  # nodes 1 and 2 under node 0, node 3 under node 1
        visible = torch.zeros(2, 5, 5, dtype=torch.bool)
        visible[0] = torch.ones(5, 5, dtype=torch.bool).tril()
        visible[1, :4, :4] = ancestor_mask(parents, 4)
        query = (torch.randn(2, heads, 5, dim) * 2).bfloat16()
        lengths, slots = torch.tensor([length, length]), torch.tensor([0, 1])
        keys[1, :, :length], values[1, :, :length] = keys[0, :, :length], values[0, :, :length]
        together = bf16_step_attention.attend(query, keys, values, slots, lengths, visible, dim ** -0.5, exact=True)
        for row in (0, 1):
            for node in range(int(visible[row].diagonal().sum())):
                path = visible[row, node, :node + 1].nonzero().squeeze(1).tolist()  # its ancestors, then itself
                alone_keys, alone_values = keys[2:3].clone(), values[2:3].clone()
                alone_keys[0, :, :length], alone_values[0, :, :length] = keys[row, :, :length], values[row, :, :length]
                for depth, slot in enumerate(path):
                    alone_keys[0, :, length + depth] = keys[row, :, length + slot]
                    alone_values[0, :, length + depth] = values[row, :, length + slot]
                alone = bf16_step_attention.attend(query[row:row + 1, :, node:node + 1], alone_keys, alone_values,
                                                   torch.tensor([0]), torch.tensor([length + len(path) - 1]),
                                                   torch.ones(1, 1, 1, dtype=torch.bool), dim ** -0.5, exact=True)
                assert torch.equal(together[row, node], alone[0, 0]), (length, row, node)


@pytest.mark.parametrize("dim", [64, 128])
def test_a_keys_score_has_the_same_bits_in_a_block_of_sixteen_or_alone(dim):
    """The scores kernel reduces 16 keys together and the keys after the last whole block one at a time, through the
    same tree of lane additions: a key's score must not depend on which path took it (attend_exact relies on it)."""
    import numpy as np
    from specdec_core.kernels import bf16_step_attention_kernel as kernel
    from specdec_core.kernels.bf16_step_attention import PASS_ROWS, _words

    torch.manual_seed(3)
    keys = _words((torch.randn(40, dim) * 3).bfloat16())
    queries = _words((torch.randn(PASS_ROWS, dim) * 3).bfloat16())
    scores = {}
    for n in (40, 33, 32, 17, 5):  # keys 0-31 in blocks at n >= 32; key 16 alone at n = 17, keys 0-4 alone at 5
        scores[n] = np.full((PASS_ROWS, 40), np.nan, dtype=np.float32)
        kernel._scores(keys, n, queries, scores[n], np.float32(0.125))
        assert not np.isnan(scores[n][:, :n]).any() and np.isnan(scores[n][:, n:]).all(), n
    for n in (33, 32, 17, 5):
        assert np.array_equal(scores[n][:, :n], scores[40][:, :n]), n
    want = torch.from_numpy(queries.view(np.uint16).astype(np.int32) << 16).view(torch.float32) @ \
        torch.from_numpy(keys.view(np.uint16).astype(np.int32) << 16).view(torch.float32).T * 0.125
    assert np.allclose(scores[40], want.numpy(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dim", [64, 128])
def test_a_query_rows_numbers_do_not_depend_on_the_rows_in_its_pass(dim):
    """A row's passes take PASS_ROWS query rows (half as many at head_dim 128), the last one the rows left (a decode
    step's 3 heads of a group in a pass of 3): each query row's scores and weighted sums must be the same bits in a
    pass of any size, or a token's numbers would depend on the step's width (attend_exact relies on it)."""
    import numpy as np
    from specdec_core.kernels import bf16_step_attention_kernel as kernel
    from specdec_core.kernels.bf16_step_attention import _words

    torch.manual_seed(5)
    n, count = 37, 7
    keys, values = (_words((torch.randn(n, dim) * 3).bfloat16()) for _ in range(2))
    queries = _words((torch.randn(count, dim) * 3).bfloat16())
    weights = torch.rand(count, n + 1)
    weights[:, n] = 0  # an odd n's last pair reads value n - 1 twice, the second time with weight 0
    weights = _words(weights.bfloat16())  # [count, (n + 1) / 2] words: bf16 weights in pairs
    all_scores = np.empty((count, n), dtype=np.float32)
    all_sums = np.empty((count, dim), dtype=np.float32)
    kernel._scores(keys, n, queries, all_scores, np.float32(0.125))
    kernel._weighted_sums(values, n, weights, all_sums)
    for first in range(count):
        for size in range(1, count - first + 1):
            scores = np.empty((size, n), dtype=np.float32)
            sums = np.empty((size, dim), dtype=np.float32)
            kernel._scores(keys, n, queries[first:first + size], scores, np.float32(0.125))
            kernel._weighted_sums(values, n, np.ascontiguousarray(weights[first:first + size]), sums)
            assert np.array_equal(scores, all_scores[first:first + size]), (first, size)
            assert np.array_equal(sums, all_sums[first:first + size]), (first, size)
    as_float = lambda words, width: torch.from_numpy(  # noqa: E731
        words.view(np.uint16)[:, :width].astype(np.int32) << 16).view(torch.float32)
    want = as_float(weights, n) @ as_float(values, dim)
    assert np.allclose(all_sums, want.numpy(), rtol=1e-3, atol=1e-2)
