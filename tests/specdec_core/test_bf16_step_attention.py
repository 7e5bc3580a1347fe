"""The bf16 dot-product attention of decode and verify steps (bf16_step_attention.py): each row's attention over
its cached keys and the new tokens it may see, within bf16 rounding of an fp32 reference."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core import bf16_step_attention
from specdec_core.draft_tree import ancestor_mask

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
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec_core import grouped_attention, invariant_attention
    from specdec_core.model_runner import ModelRunner
    from tests.specdec_core.test_deterministic import SEQUENCE, feed, runner_in
    from tests.tiny_models import TINY_DECODER, DigitsTokenizer

    def wide_heads():
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_DECODER, "head_dim": 64})).eval()
        return ModelRunner(model, DigitsTokenizer(), "tiny-llama-64", "cpu", torch.float32)

    runner = runner_in(torch.bfloat16, wide_heads)
    runner.deterministic = False
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
