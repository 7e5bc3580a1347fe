"""The AMX tile attention of decode and verify steps (amx_step_attention.py): each row's attention over its cached
keys and the new tokens it may see, within bf16 rounding of an fp32 reference, and a runner whose plan picked it."""

import pytest
import torch

from specdec_core.kernels import amx_step_attention, bf16_step_attention
from specdec_core.kernels.kernel_plan import KernelPlan
from specdec_core.loop.draft_tree import ancestor_mask
from tests.specdec_core.test_bf16_step_attention import reference

pytestmark = pytest.mark.skipif(not amx_step_attention.usable(64), reason="no AMX tiles on this CPU")


def attend(query, keys, values, slots, lengths, visible, scale):
    return amx_step_attention.Step(visible, lengths, slots).attend(query, keys, values, scale)


@pytest.mark.parametrize("num_new", [4, 7])
def test_decode_and_verify_rows_attend_their_own_keys_within_bf16_rounding(num_new):
    """Rows at other cache slots with cached lengths on and off the tiles' 16 and 32 keys (0, 15, 16, 31, 33, 100),
    a chain, a tree (node 2 a sibling of node 1), padding after a row's real tokens, and at 7 tokens a row more
    query rows (7 x 3 heads) than a pass takes: each equals the fp32 reference within bf16 rounding; padding is
    zero. The cache past each row's keys holds NaN, which must never be read."""
    torch.manual_seed(0)
    dim, heads, kv_heads, capacity, rows = 64, 9, 3, 120, 6
    keys = torch.full((rows, kv_heads, capacity, dim), float("nan")).to(torch.bfloat16)
    values = keys.clone()
    lengths = torch.tensor([37, 0, 100, 15, 16, 31])
    slots = torch.tensor([3, 1, 0, 2, 5, 4])
    visible = torch.zeros(rows, num_new, num_new, dtype=torch.bool)
    visible[0] = torch.ones(num_new, num_new, dtype=torch.bool).tril()  # a chain
    visible[1, :1, :1] = True  # one token (a decode step), padding after it
    visible[2, :3, :3] = ancestor_mask([-1, -1], 3)  # a tree: the root's two children
    visible[3, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    visible[4] = torch.ones(num_new, num_new, dtype=torch.bool).tril()
    visible[5, :2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()  # 31 + 2 keys: one past a value tile
    for r in range(rows):
        real = int(visible[r].diagonal().sum())
        keys[slots[r], :, :lengths[r] + real] = (torch.randn(kv_heads, int(lengths[r]) + real, dim) * 2).bfloat16()
        values[slots[r], :, :lengths[r] + real] = torch.randn(kv_heads, int(lengths[r]) + real, dim).bfloat16()
    query = (torch.randn(rows, heads, num_new, dim) * 2).to(torch.bfloat16)
    out = attend(query, keys, values, slots, lengths, visible, dim ** -0.5)
    assert out.shape == (rows, num_new, heads, dim) and out.dtype == torch.bfloat16
    for r in range(rows):
        real = int(visible[r].diagonal().sum())
        want = reference(query[r], keys, values, int(slots[r]), int(lengths[r]), visible[r])
        assert (out[r, :real].float() - want).abs().max() < 2e-2, r
        assert not out[r, real:].any()


def test_other_head_dims_are_left_to_the_dot_product_kernel():
    assert not amx_step_attention.usable(128) and not amx_step_attention.usable(32)


def test_a_runner_whose_plan_picked_the_tiles_steps_through_them_but_not_with_deterministic(monkeypatch):
    """A bf16 runner (head_dim 64) whose plan chose "amx" sends every decode and verify step there, with logits of
    the dot-product kernel's within bf16 rounding; --deterministic keeps the dot-product kernel's exact one."""
    from specdec_core.model import grouped_attention
    from tests.specdec_core.test_deterministic import SEQUENCE, feed, runner_in
    from tests.tiny_models import tiny_llama_64

    runner = runner_in(torch.bfloat16, tiny_llama_64)
    runner.deterministic = False
    pieces = [grouped_attention.MAX_QUERIES + 4, 5, 3] + [1] * (len(SEQUENCE) - grouped_attention.MAX_QUERIES - 12)
    runner.kernel_plan = None
    theirs = feed(runner, pieces)
    runner.kernel_plan = KernelPlan("test", "panel", {}, (), 0.0, 0, step_attention="amx",
                                    step_ms={"bf16_dot": [0.5, 0.9], "amx": [0.46, 0.52]})
    calls = []
    real_attend = amx_step_attention.Step.attend
    monkeypatch.setattr(amx_step_attention.Step, "attend", lambda self, *args: calls.append(args[0].shape[2])
                        or real_attend(self, *args))
    ours = feed(runner, pieces)
    assert sorted(set(calls)) == [1, 3, 5] and len(calls) == runner.num_layers * (len(pieces) - 1)
    assert torch.allclose(ours, theirs, atol=0.1), (ours - theirs).abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
    runner.deterministic = True
    calls.clear()
    feed(runner, pieces)
    assert not calls and bf16_step_attention.usable(64)
