"""The panel kernel's fp32 and bf16 linears (panel_linear.py): the same product as nn.Linear, and a row's numbers its
own."""

import pytest
import torch

from specdec_core.kernels import bf16_dot, panel_linear
from specdec_core.kernels.panel_linear import PanelLinear, panel_linears, to_panels
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


BF16_KERNELS = ["dot", "widen"]  # the CPU's bf16 dot product (bf16_dot.py), else bf16 widened into fp32 sums


def bf16_kernel(kind: str, monkeypatch) -> None:
    if kind == "dot" and not bf16_dot.available():
        pytest.skip(f"no bf16 dot-product kernel here: {bf16_dot.kernel.unavailable}")
    if kind == "widen":
        monkeypatch.setattr(bf16_dot, "available", lambda: False)


@pytest.mark.parametrize("kind", BF16_KERNELS)
def test_a_bf16_panel_linear_sums_the_products_in_fp32_and_rounds_once(kind, monkeypatch):
    """bf16 weights summed in fp32: the result is the product of the same bf16 numbers, with the bias, rounded to
    bf16 once (as oneDNN's bf16 linear rounds; the sum order differs), and an odd input width is padded."""
    bf16_kernel(kind, monkeypatch)
    torch.manual_seed(2)
    linear = torch.nn.Linear(1537, 40).to(torch.bfloat16)  # a down projection's depth, odd; 40: padded columns
    panel = PanelLinear(linear)
    assert panel.panels.dim() == (4 if kind == "dot" else 3)
    x = torch.randn(5, 1537).to(torch.bfloat16)
    with torch.no_grad():
        exact = (x.double() @ linear.weight.double().T + linear.bias.double()).to(torch.bfloat16)
        got = panel(x)
    assert got.dtype == torch.bfloat16 and panel.panels.dtype == torch.bfloat16  # one bf16 copy of the weights
    assert torch.equal(panel.weight, linear.weight.detach())
    # fp32 sums of 1,536 products are within a few fp32 ulps of the exact sum: at most one bf16 rounding step apart
    assert ((got.float() - exact.float()).abs() <= exact.float().abs() * 2 ** -7 + 1e-6).all()
    assert (got == exact).float().mean() > 0.95


def test_a_bf16_linear_without_a_bias_rounds_its_fp32_sums_as_torch_does(monkeypatch):
    """Without a bias the dot kernel rounds its sums itself (no fp32 result to convert): the same bf16 numbers as
    its fp32 sums rounded by torch, bit for bit, with and without padded columns."""
    bf16_kernel("dot", monkeypatch)
    torch.manual_seed(6)
    for width in (64, 40):
        panel = PanelLinear(torch.nn.Linear(96, width, bias=False).to(torch.bfloat16))
        x = torch.randn(9, 96).to(torch.bfloat16) * 3
        sums = torch.from_numpy(bf16_dot.matmul(x, panel.panels_array))[:, :width]  # [9, width] fp32
        got = panel(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, sums.to(torch.bfloat16)), width


@pytest.mark.parametrize("dtype,kind", [(torch.float32, ""), (torch.bfloat16, "dot"), (torch.bfloat16, "widen")],
                         ids=["fp32", "bf16-dot", "bf16-widen"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype, kind, monkeypatch):
    """Bitwise: one row alone, among 1..17 others, at any place in a call, and in a call of more rows than one task
    takes (1,100 rows: the bf16 dot kernel's blocks of 552, the fp32 kernel's of 220) gives the same numbers; this is
    what lets a verify step, a prefill and a plain step agree on a row. (oneDNN's bf16 linear does not promise it: a
    [M, 1536] x [1536, 576] row changed from M = 14 on an avx512_bf16 CPU.) No rows give no rows."""
    if kind:
        bf16_kernel(kind, monkeypatch)
    torch.manual_seed(1)
    linear = torch.nn.Linear(1536, 64, bias=False).to(dtype)
    panel = PanelLinear(linear)
    x = torch.randn(1100, 1536).to(dtype)
    everything = panel(x)  # [1100, 64]
    for rows in range(1, 18):
        assert torch.equal(panel(x[:rows]), everything[:rows]), rows
    for first in (1, 3, 5, 127, 128, 130, 217, 549, 1090):
        assert torch.equal(panel(x[first:first + 7]), everything[first:first + 7]), first
    assert torch.equal(panel(x[129:130]), everything[129:130])
    assert torch.equal(panel(x[100:300]), everything[100:300])  # 200 rows: one block
    assert panel(x[:0]).shape == (0, 64)


def test_panels_hold_each_column_of_the_weight_in_order():
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)  # [out, in]
    panels = to_panels(weight)  # [3, 3, 16]
    assert panels.shape == (3, 3, panel_linear.PANEL)
    assert torch.equal(panels[1, :, 0], weight[16])
    assert torch.equal(panels[2, :, 7], weight[39])
    assert not panels[2, :, 8:].any()  # padding columns


def test_load_puts_fp32_linears_on_panels_unless_switched_off(monkeypatch):
    from specdec_core.model.model_runner import tune_for_cpu

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
    """The switch moves a bf16 model's linears, still on PyTorch's bf16 linear, to the panel kernel (row-invariant)
    and rebuilds the fast forward over them."""
    from specdec_core.model.model_runner import ModelRunner

    base = tiny_llama()
    model = base.model.to(torch.bfloat16)
    runner = ModelRunner(model, base.tokenizer, base.name, "cpu", torch.bfloat16)
    assert type(runner.model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    runner.deterministic = True
    assert isinstance(runner.model.model.layers[0].mlp.down_proj, PanelLinear)
    assert isinstance(runner.model.get_output_embeddings(), PanelLinear)
    assert runner.fast.layers[0].down.module is runner.model.model.layers[0].mlp.down_proj


@pytest.mark.parametrize("kind", BF16_KERNELS)
def test_bf16_layers_stack_into_one_call_and_each_still_computes_alone(kind, monkeypatch):
    bf16_kernel(kind, monkeypatch)
    torch.manual_seed(3)
    gate, up = (PanelLinear(torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)) for _ in range(2))
    x = torch.randn(9, 64).to(torch.bfloat16)
    alone = torch.cat([gate(x), up(x)], dim=1)
    both = panel_linear.stack(gate, up)
    assert torch.equal(both(x), alone) and torch.equal(torch.cat([gate(x), up(x)], dim=1), alone)
    assert gate.panels.data_ptr() == both.panels.data_ptr()  # views: one copy of the weights
    odd = PanelLinear(torch.nn.Linear(64, 48 if kind == "dot" else 20, bias=False).to(torch.bfloat16))
    assert panel_linear.stack(odd, up) is None  # its panels would not end where the second's begin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_three_stacked_linears_compute_each_and_keep_one_copy(dtype):
    """q, k and v in one call: [q(x), k(x), v(x)] bitwise, and each module computes alone from a view of the stack."""
    torch.manual_seed(5)
    modules = [PanelLinear(torch.nn.Linear(64, width, bias=True).to(dtype)) for width in (64, 32, 32)]
    x = torch.randn(7, 64).to(dtype)
    before = torch.cat([m(x) for m in modules], dim=1)
    stacked = panel_linear.stack(*modules)
    assert torch.equal(stacked(x), before)
    assert torch.equal(torch.cat([m(x) for m in modules], dim=1), before)
    assert [m.panels.data_ptr() for m in modules][0] == stacked.panels.data_ptr()
    assert modules[2].panels.data_ptr() > modules[1].panels.data_ptr() > modules[0].panels.data_ptr()
