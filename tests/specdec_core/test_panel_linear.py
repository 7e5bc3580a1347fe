"""The panel kernel's fp32 linear (panel_linear.py): the same product as nn.Linear, and a row's numbers its own."""

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


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Bitwise: one row alone, among 1..17 others, at any place in a call, and past a row block (129 rows) gives the
    same numbers; this is what lets a verify step, a prefill and a plain step agree on a row."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(96, 64, bias=False)
    panel = PanelLinear(linear)
    x = torch.randn(140, 96)
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


def test_panel_linears_replaces_fp32_linears_only():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    assert panel_linears(model) == 1
    assert isinstance(model[0], PanelLinear) and type(model[1]) is torch.nn.Linear
