"""A drafter with int8 linear layers (--drafter-dtype int8): cheaper drafter tokens, the target's output unchanged."""

import pytest
import torch

from specdec_core.drafters.base import NoDrafter
from specdec_core.drafters.draft_model import DraftModelDrafter, DraftModelPool
from specdec_core.engine import Engine, EngineConfig
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.requests import DecodeParams
from specdec_core.model.int8_linear import quantize_int8
from specdec_core.model.lm_head import SubsetHead
from specdec_core.model.model_runner import ModelRunner
from tests.tiny_models import DigitsTokenizer, tiny_llama


def int8_copy(seed: int = 0, dtype: torch.dtype = torch.float32) -> ModelRunner:
    """The tiny model with int8 weights: bf16 -> weight-only int8 (Int8WeightLinear), fp32 -> dynamic quantization."""
    runner = tiny_llama(seed)
    runner.model.to(dtype)
    quantize_int8(runner.model)
    return ModelRunner(runner.model, DigitsTokenizer(), "tiny-llama-int8", "cpu", dtype, quantized=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_drafter_leaves_the_output_the_targets_alone_and_in_a_batch(dtype):
    target, drafter_model = tiny_llama(0), int8_copy(0, dtype)
    assert drafter_model.dtype_name == "int8" and drafter_model.vocab_size == target.vocab_size
    prompts = [[5, 9, 14, 3, 7], [11, 2, 2, 40, 8, 1], [60, 61, 62]]
    params = DecodeParams(max_new_tokens=20)

    def run(drafters):
        decoder = BatchDecoder(target, max_batch=len(prompts))
        decoder.budget.enabled = False  # verify every drafted token
        got = dict((request.key, result) for request, result in decoder.run(
            DecodeRequest(i, p, params, d) for i, (p, d) in enumerate(zip(prompts, drafters))))
        return [got[i].token_ids for i in range(len(prompts))], decoder.stats

    plain, _ = run([NoDrafter() for _ in prompts])
    pool = DraftModelPool(drafter_model)
    batched, stats = run([DraftModelDrafter(pool, num_tokens=4) for _ in prompts])
    assert batched == plain
    # The int8 copy drafts mostly what the target says (it is the same model, rounded), so drafts are accepted.
    assert stats.accepted_tokens > stats.verified_tokens // 2
    alone, _ = run([DraftModelDrafter(DraftModelPool(int8_copy(0, dtype)), num_tokens=4), NoDrafter(), NoDrafter()])
    assert alone[0] == plain[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_subset_head_over_int8_weights_gives_the_whole_heads_logits_at_its_tokens(dtype):
    runner = int8_copy(0, dtype)
    hidden = torch.randn(3, 64, dtype=dtype)
    ids = torch.tensor([1, 5, 17, 90])
    whole = runner.head_logits(hidden)  # [3, vocab]
    subset = SubsetHead(runner, ids)(hidden)
    assert torch.allclose(subset[:, ids], whole[:, ids], atol=0.05)  # the int8 kernel vs the dequantized weight
    assert torch.isinf(subset[:, 0]).all()


def test_weight_only_int8_rounds_each_output_channel_to_127_steps_of_its_own_scale():
    """Int8WeightLinear: the kernel's product equals x times the dequantized weight, and that weight is within half
    a step (scale / 2) of the bf16 one, per output channel."""
    from specdec_core.model.int8_linear import DEQUANTIZE_ROWS, Int8WeightLinear

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight[3] *= 50  # one channel far larger: its scale is its own
    int8 = Int8WeightLinear(linear)
    assert int8.weight_int8.dtype == torch.int8 and int8.weight_int8.abs().max() == 127
    error = (int8.dequantized().float() - linear.weight.float()).abs()  # [48, 64]
    assert (error <= int8.scale.float()[:, None] * 0.51 + 1e-2 * linear.weight.float().abs()).all()
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x.float(), int8.dequantized().float(), linear.bias.float())
    torch.testing.assert_close(int8(x).float(), expected, atol=0.1, rtol=0.02)
    assert int8(x).shape == (2, 5, 48)
    many = torch.randn(3, DEQUANTIZE_ROWS, 64, dtype=torch.bfloat16)  # a prompt catch-up: the bf16 GEMM path
    expected = torch.nn.functional.linear(many.float(), int8.dequantized().float(), linear.bias.float())
    torch.testing.assert_close(int8(many).float(), expected, atol=0.1, rtol=0.02)


def test_int8_is_the_default_drafter_dtype_of_a_bf16_target_on_a_cpu_only():
    from types import SimpleNamespace

    from specdec_core.engine import default_drafter_dtype

    assert default_drafter_dtype(SimpleNamespace(device="cpu", dtype=torch.bfloat16, dtype_name="bfloat16")) == "int8"
    assert default_drafter_dtype(SimpleNamespace(device="cpu", dtype=torch.float32, dtype_name="float32")) == "float32"
    assert default_drafter_dtype(SimpleNamespace(device="cuda", dtype=torch.bfloat16,
                                                 dtype_name="bfloat16")) == "bfloat16"


def test_int8_is_refused_for_targets_and_off_the_cpu():
    with pytest.raises(ValueError, match="drafters only"):
        Engine(EngineConfig(model="smollm2-135m", dtype="int8"))
    with pytest.raises(ValueError, match="CPU only"):
        ModelRunner.load("smollm2-135m", dtype="int8", device="cuda")


class _StopsAfterThree(DraftModelDrafter):
    """A pooled drafter with a stop of its own (as slem's priced confidence stop): 3 tokens, whatever it asked."""

    prices_its_length = True

    def propose(self, tokens, max_tokens):
        self.drafted_now = 0
        return super().propose(tokens, max_tokens)

    def choose(self, logits, probs):
        token, more = super().choose(logits, probs)
        self.drafted_now += 1
        return token, more and self.drafted_now < 3


@pytest.mark.parametrize("priced", [True, False])
def test_a_drafter_that_prices_its_length_drafts_past_the_plans_cut_and_keeps_its_length(priced):
    """The plan (here: verifying 2+ tokens costs 10 plain steps, so it plans 1) decides only whether such a row
    drafts; its own stop ends the draft. Its length neither grows on its fully accepted drafts nor shrinks: its stop,
    not the length, ended them. The output stays the target's."""
    from specdec_core.loop.speculation_budget import SpeculationBudget, StepCostModel

    target = tiny_llama(0)
    prompt, params = [5, 9, 14, 3, 7], DecodeParams(max_new_tokens=20)
    cost = StepCostModel(fixed=lambda rows, width: 1.0 if width == 1 else 1.05 if width == 2 else 10.0)
    budget = SpeculationBudget.for_target(target, cost=cost, check_payoff=False, min_advantage=1.0)
    decoder = BatchDecoder(target, max_batch=1, budget=budget)
    drafter = _StopsAfterThree(DraftModelPool(tiny_llama(0)), num_tokens=6, adaptive=True)
    drafter.prices_its_length = priced
    [(_, result)] = list(decoder.run([DecodeRequest(0, prompt, params, drafter)]))
    plain = BatchDecoder(target, max_batch=1)
    [(_, reference)] = list(plain.run([DecodeRequest(0, prompt, params, NoDrafter())]))
    assert result.token_ids == reference.token_ids
    stats = decoder.stats
    assert stats.drafted_tokens == stats.verified_tokens > 0  # drafted no further than verified
    if priced:
        assert stats.verified_tokens > stats.steps  # 3-token drafts: the plan's 1 did not cut them
    else:
        assert stats.verified_tokens <= stats.steps  # the plan's cut: 1 token per step
    assert drafter.length.current == 6 if priced else drafter.length.current <= 6
