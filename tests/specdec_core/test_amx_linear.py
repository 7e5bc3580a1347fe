"""bf16 linears on the AMX tiles (amx_linear.py): x . W^T for any row count and shape, rounded as oneDNN rounds,
and a kernel-plan candidate."""

import pytest
import torch

from specdec_core.kernels import amx_linear, linear_plan

pytestmark = pytest.mark.skipif(not amx_linear.usable(), reason="no AMX tiles on this CPU")


@pytest.mark.parametrize("rows,out_features,in_features", [(16, 576, 576), (1, 960, 576), (7, 100, 40),
                                                            (33, 576, 1536), (64, 192, 96), (48, 64, 32)])
def test_rows_and_shapes_off_the_tiles_give_the_fp32_products_within_bf16_rounding(rows, out_features, in_features):
    """One block of rows and several (paired two at a time, an odd last one alone), outputs and inputs that are not
    whole tiles (zero-padded in the layout and the input): each output within one bf16 rounding of the fp32
    product, and the shape asked for."""
    torch.manual_seed(rows)
    weight = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    out = amx_linear.linear(x, amx_linear.pack(weight), out_features)
    want = x.float() @ weight.float().T
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert ((out.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-3).all()


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Alone (one padded block) or among 40 rows (blocks in pairs): the same bits, as the plan's table says
    (row_invariant)."""
    torch.manual_seed(1)
    weight = (torch.randn(128, 96) * 0.05).bfloat16()
    packed = amx_linear.pack(weight)
    x = torch.randn(40, 96).bfloat16()
    together = amx_linear.linear(x, packed, 128)
    for row in (0, 17, 39):
        assert torch.equal(amx_linear.linear(x[row:row + 1], packed, 128)[0], together[row])


def test_the_plan_times_it_as_a_candidate():
    candidate = next(c for c in linear_plan.CANDIDATES if c.name == "amx_tiles")
    assert candidate.dtypes == (torch.bfloat16,) and candidate.usable() and candidate.row_invariant
    weight = (torch.randn(64, 64) * 0.05).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    assert torch.allclose(candidate.build(weight)(x).float(), x.float() @ weight.float().T, atol=0.02)
