"""The compiled residual add + RMSNorm and SiLU gate (residual_norm.py), and gate / up stacked on panels."""

import pytest
import torch

from specdec_core.kernels import panel_linear, residual_norm
from specdec_core.kernels.panel_linear import PanelLinear

pytestmark = pytest.mark.skipif(not residual_norm.usable(torch.zeros(1)), reason="numba cannot compile it here")


def eager_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_add_rms_norm_is_the_sum_and_its_norm_and_each_row_is_its_own():
    torch.manual_seed(0)
    x, delta, weight = torch.randn(37, 576) * 3, torch.randn(37, 576), torch.rand(576) + 0.5
    total, normed = residual_norm.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)  # one fp32 add, as eager
    assert torch.allclose(normed, eager_rms_norm(x + delta, weight, 1e-5), rtol=1e-5, atol=1e-6)
    alone = residual_norm.add_rms_norm(x[20:21], delta[20:21], weight, 1e-5)[1]
    assert torch.equal(alone, normed[20:21])
    without = residual_norm.add_rms_norm(x, None, weight, 1e-5)
    assert torch.equal(without[0], x) and torch.allclose(without[1], eager_rms_norm(x, weight, 1e-5), rtol=1e-5,
                                                          atol=1e-6)


def test_silu_mul_of_stacked_gate_and_up():
    torch.manual_seed(1)
    gate, up = torch.randn(9, 64) * 4, torch.randn(9, 64)
    got = residual_norm.silu_mul(torch.cat([gate, up], dim=1))
    assert torch.allclose(got, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not panel_linear.available(), reason="numba cannot compile the panel kernel here")
def test_stacked_panels_compute_both_linears_and_each_still_alone():
    """One call gives [gate(x), up(x)] bitwise; the modules' panels become views of the stacked ones (one copy)."""
    torch.manual_seed(2)
    gate, up = PanelLinear(torch.nn.Linear(48, 32, bias=False)), PanelLinear(torch.nn.Linear(48, 32, bias=False))
    x = torch.randn(5, 48)
    before = torch.cat([gate(x), up(x)], dim=1)
    both = panel_linear.stack(gate, up)
    assert torch.equal(both(x), before)
    assert torch.equal(torch.cat([gate(x), up(x)], dim=1), before)
    assert gate.panels.data_ptr() == both.panels.data_ptr()
    odd = PanelLinear(torch.nn.Linear(48, 20, bias=False))
    assert panel_linear.stack(odd, up) is None  # its panels would not end where the second's begin


def test_bf16_add_rms_norm_rounds_where_the_eager_ops_round():
    """bf16 in and out: the sum is the eager bf16 add bit for bit; the normed row is the eager bf16 RMSNorm (fp32
    inside, rounded, times the weight) up to one bf16 step from the mean square's summation order; a row alone is
    bitwise the row in a batch; no delta is the row itself."""
    torch.manual_seed(3)
    x = (torch.randn(37, 576) * 3).bfloat16()
    delta, weight = torch.randn(37, 576).bfloat16(), (torch.rand(576) + 0.5).bfloat16()
    total, normed = residual_norm.add_rms_norm(x, delta, weight, 1e-5)
    assert total.dtype == normed.dtype == torch.bfloat16
    assert torch.equal(total, x + delta)
    x32 = (x + delta).float()
    eager = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.allclose(normed.float(), eager.float(), rtol=2 ** -7, atol=0)
    assert (normed == eager).float().mean() > 0.98
    assert torch.equal(residual_norm.add_rms_norm(x[20:21], delta[20:21], weight, 1e-5)[1], normed[20:21])
    assert torch.equal(residual_norm.add_rms_norm(x, None, weight, 1e-5)[0], x)


def test_bf16_silu_mul_rounds_where_the_eager_ops_round():
    torch.manual_seed(4)
    gate, up = (torch.randn(9, 64) * 6).bfloat16(), torch.randn(9, 64).bfloat16()
    got = residual_norm.silu_mul(torch.cat([gate, up], dim=1))
    eager = torch.nn.functional.silu(gate) * up
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), eager.float(), rtol=2 ** -7, atol=1e-30)
    assert (got == eager).float().mean() > 0.98
