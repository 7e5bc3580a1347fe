"""fp32 weights kept as their exact block codes (coded_panels.py): found only where they rebuild every weight bit for
bit, and summed by the panel kernel to the same bits as the fp32 panels."""

import pytest
import torch

from specdec_core.kernels import coded_panels, panel_linear
from specdec_core.kernels.panel_linear import PanelLinear, to_panels

pytestmark = pytest.mark.skipif(not panel_linear.available(), reason="numba cannot compile the panel kernel here")


def coded_weight(out_features: int, in_features: int, bits: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return coded_panels.round_to_codes(torch.randn(out_features, in_features, generator=generator) * 0.02, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_block_codes_are_found_and_rebuild_the_weight_bit_for_bit(bits):
    """A weight made of block codes (as a GGUF file's dequantized Q4_1 or Q8_0 weights are) is found as codes of that
    width, and the codes rebuild it exactly, its padding columns (37 -> 48) as zeros."""
    weight = coded_weight(37, 96, bits, seed=bits)
    panels = coded_panels.encode(weight)
    assert panels is not None and panels.bits == bits
    assert panels.shape == (3, 96, 16) and panels.codes.dtype == (torch.uint8 if bits == 4 else torch.int8)
    dense = panels.dense()
    assert torch.equal(dense[:37], weight) and not dense[37:].any()
    assert panels.nbytes() < weight.numel() * 4 / (4 if bits == 4 else 2)


def test_weights_that_are_not_exact_codes_stay_dense():
    """Plain fp32 weights, a coded weight with one value moved by one ulp, a bf16 weight and an input width that is
    not whole blocks are not coded: nothing is rounded."""
    weight = coded_weight(16, 64, 4, seed=1)
    moved = weight.clone()
    moved[3, 17] = torch.nextafter(moved[3, 17], torch.tensor(1.0))
    for other in (torch.randn(16, 64), moved, weight.to(torch.bfloat16), coded_weight(16, 96, 4, seed=2)[:, :80]):
        assert coded_panels.encode(other.contiguous()) is None
    assert coded_panels.encode(weight) is not None


@pytest.mark.parametrize("bits", [4, 8])
def test_the_coded_kernel_gives_the_fp32_panel_kernels_bits(bits):
    """Bitwise equal to the fp32 panel kernel over the same weights, for every row remainder (1..9 rows), rows past
    one task's block (600 rows: blocks of 200), an odd output width and a bias."""
    torch.manual_seed(bits)
    weight = coded_weight(40, 160, bits, seed=10 + bits)
    linear = torch.nn.Linear(160, 40)
    linear.weight.data = weight
    coded, dense = PanelLinear(linear), PanelLinear(panels=to_panels(weight), bias=linear.bias, out_features=40)
    assert isinstance(coded.panels, coded_panels.CodedPanels) and not isinstance(dense.panels, coded_panels.CodedPanels)
    with torch.no_grad():
        for rows in (*range(1, 10), 600):
            x = torch.randn(rows, 160) * 3
            assert torch.equal(coded(x), dense(x)), rows
        assert torch.equal(coded.weight, weight)


def test_coded_linears_stack_into_one_coded_call_and_mixed_ones_do_not(monkeypatch):
    """q, k and v as codes stack into one coded call (views into it, the same outputs); a coded and a dense module
    cannot share a call. With SPECBATCH_CODED_WEIGHTS=0 a coded weight stays fp32 panels."""
    torch.manual_seed(3)
    modules = []
    for width, seed in ((64, 1), (32, 2), (32, 3)):
        linear = torch.nn.Linear(64, width, bias=False)
        linear.weight.data = coded_weight(width, 64, 4, seed)
        modules.append(PanelLinear(linear))
    x = torch.randn(5, 64)
    with torch.no_grad():
        alone = [m(x) for m in modules]
        stacked = panel_linear.stack(*modules)
        assert isinstance(stacked.panels, coded_panels.CodedPanels)
        assert torch.equal(stacked(x), torch.cat(alone, dim=1))
        assert all(torch.equal(m(x), a) for m, a in zip(modules, alone))
    assert modules[0].panels.data_ptr() == stacked.panels.data_ptr()
    assert panel_linear.stack(modules[0], PanelLinear(torch.nn.Linear(64, 32, bias=False))) is None
    monkeypatch.setenv(panel_linear.CODED_ENV, "0")
    linear = torch.nn.Linear(64, 16, bias=False)
    linear.weight.data = coded_weight(16, 64, 4, seed=4)
    assert not isinstance(PanelLinear(linear).panels, coded_panels.CodedPanels)


@pytest.mark.slow
def test_the_default_models_fp32_linears_are_its_gguf_codes(engine):
    """The registry's SmolLM2 (a Q4_1 GGUF with a Q8_0 embedding) loads in fp32 with every decoder linear held as
    4-bit codes and its head as 8-bit codes; a layer computes the bits its dense fp32 panels compute."""
    model = engine.target.model
    layers = model.get_decoder().layers
    for layer in layers:
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            assert type(module) is PanelLinear and isinstance(module.panels, coded_panels.CodedPanels)
            assert module.panels.bits == 4
    head = model.get_output_embeddings()
    assert isinstance(head.panels, coded_panels.CodedPanels) and head.panels.bits == 8
    down = layers[3].mlp.down_proj
    dense = PanelLinear(panels=to_panels(down.weight), out_features=down.out_features)
    x = torch.randn(7, down.in_features)
    with torch.no_grad():
        assert torch.equal(down(x), dense(x))
