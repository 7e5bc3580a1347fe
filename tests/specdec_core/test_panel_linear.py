"""The panel kernel's fp32 and bf16 linears (panel_linear.py): the same product as nn.Linear, and a row's numbers its
own."""

import pytest
import torch

from specdec_core import panel_linear
from specdec_core.panel_linear import PanelLinear, panel_linears, to_panels
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not panel_linear.available(), reason="numba cannot compile the panel kernel here")


def test_a_panel_linear_computes_the_linear_with_bias_and_odd_widths():
    """Equal to nn.Linear within fp32 rounding, with a bias, an output width that is not a multiple of the panel
    (the padded columns are cut off) and any leading shape."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(72, 37)
    panel = PanelLinear(linear)
    x = torch.randn(3, 11, 72)
    with torch.no_grad():
        assert torch.allclose(panel(x), linear(x), atol=1e-5)
    assert panel(x).shape == (3, 11, 37)
    assert torch.equal(panel.weight, linear.weight.detach())


def test_a_bf16_panel_linear_sums_the_exact_products_in_fp32_and_rounds_once():
    """bf16 weights are read as their bits and widened exactly: the result is the fp32 product of the same bf16
    numbers, with the bias, rounded to bf16 once (as oneDNN's bf16 linear rounds; its sum order differs)."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(1536, 40).to(torch.bfloat16)  # a down projection's depth; 40: padded columns
    panel = PanelLinear(linear)
    x = torch.randn(5, 1536).to(torch.bfloat16)
    with torch.no_grad():
        exact = (x.double() @ linear.weight.double().T + linear.bias.double()).to(torch.bfloat16)
        got = panel(x)
    assert got.dtype == torch.bfloat16 and panel.panels.dtype == torch.bfloat16  # one bf16 copy of the weights
    assert torch.equal(panel.weight, linear.weight.detach())
    # fp32 sums of 1,536 products are within a few fp32 ulps of the exact sum: at most one bf16 rounding step apart
    assert ((got.float() - exact.float()).abs() <= exact.float().abs() * 2 ** -7 + 1e-6).all()
    assert (got == exact).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype):
    """Bitwise: one row alone, among 1..17 others, at any place in a call, and past a row block (129 rows) gives the
    same numbers; this is what lets a verify step, a prefill and a plain step agree on a row. (oneDNN's bf16 linear
    does not promise it: a [M, 1536] x [1536, 576] row changed from M = 14 on an avx512_bf16 CPU.)"""
    torch.manual_seed(1)
    linear = torch.nn.Linear(1536, 64, bias=False).to(dtype)
    panel = PanelLinear(linear)
    x = torch.randn(140, 1536).to(dtype)
    everything = panel(x)  # [140, 64]
    for rows in range(1, 18):
        assert torch.equal(panel(x[:rows]), everything[:rows]), rows
    for first in (1, 3, 5, 127, 128, 130):
        assert torch.equal(panel(x[first:first + 7]), everything[first:first + 7]), first
    assert torch.equal(panel(x[129:130]), everything[129:130])


def test_panels_hold_each_column_of_the_weight_in_order():
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # [out, in]
    panels = to_panels(weight)  # [3, 3, 16]
    assert panels.shape == (3, 3, panel_linear.PANEL)
    assert torch.equal(panels[1, :, 0], weight[16])
    assert torch.equal(panels[2, :, 7], weight[39])
    assert not panels[2, :, 8:].any()  # padding columns


def test_load_puts_fp32_linears_on_panels_unless_switched_off(monkeypatch):
    from specdec_core.model_runner import tune_for_cpu

    model = tiny_llama().model
    tune_for_cpu(model)
    assert isinstance(model.model.layers[0].mlp.up_proj, PanelLinear)
    assert isinstance(model.get_output_embeddings(), PanelLinear)
    monkeypatch.setenv(panel_linear.DISABLE_ENV, "0")
    model = tiny_llama().model
    tune_for_cpu(model)
    assert not isinstance(model.model.layers[0].mlp.up_proj, PanelLinear)


def test_panel_linears_replaces_fp32_linears_only_unless_bf16_is_asked_for():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    assert panel_linears(model) == 1
    assert isinstance(model[0], PanelLinear) and type(model[1]) is torch.nn.Linear
    assert panel_linears(model, dtypes=(torch.bfloat16,)) == 1
    assert isinstance(model[1], PanelLinear) and model[1].panels.dtype == torch.bfloat16


def test_deterministic_bf16_puts_the_linears_and_head_on_bf16_panels():
    """The switch moves a bf16 model's linears to the panel kernel (row-invariant) and rebuilds the fast forward
    over them; without it they stay on PyTorch's bf16 linear."""
    from tests.specdec_core.test_deterministic import runner_in

    runner = runner_in(torch.bfloat16)
    assert isinstance(runner.model.model.layers[0].mlp.down_proj, PanelLinear)
    assert isinstance(runner.model.get_output_embeddings(), PanelLinear)
    assert runner.fast.layers[0].down.module is runner.model.model.layers[0].mlp.down_proj
