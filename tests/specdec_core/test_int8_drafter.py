"""A drafter with int8 linear layers (--drafter-dtype int8): cheaper drafter tokens, the target's output unchanged."""

import pytest
import torch

from specdec_core.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.decode import DecodeParams
from specdec_core.drafters.base import NoDrafter
from specdec_core.drafters.draft_model import DraftModelDrafter, DraftModelPool
from specdec_core.engine import Engine, EngineConfig
from specdec_core.model_runner import ModelRunner, SubsetHead, quantize_int8
from tests.tiny_models import DigitsTokenizer, tiny_llama


def int8_copy(seed: int = 0) -> ModelRunner:
    runner = tiny_llama(seed)
    quantize_int8(runner.model)
    return ModelRunner(runner.model, DigitsTokenizer(), "tiny-llama-int8", "cpu", torch.float32, quantized=True)


def test_an_int8_drafter_leaves_the_output_the_targets_alone_and_in_a_batch():
    target, drafter_model = tiny_llama(0), int8_copy(0)
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
    alone, _ = run([DraftModelDrafter(DraftModelPool(int8_copy(0)), num_tokens=4), NoDrafter(), NoDrafter()])
    assert alone[0] == plain[0]


def test_a_subset_head_over_int8_weights_gives_the_whole_heads_logits_at_its_tokens():
    runner = int8_copy(0)
    hidden = torch.randn(3, 64)
    ids = torch.tensor([1, 5, 17, 90])
    whole = runner.head_logits(hidden)  # [3, vocab]
    subset = SubsetHead(runner, ids)(hidden)
    assert torch.allclose(subset[:, ids], whole[:, ids], atol=0.05)  # the int8 kernel vs the dequantized weight
    assert torch.isinf(subset[:, 0]).all()


def test_int8_is_refused_for_targets_and_off_the_cpu():
    with pytest.raises(ValueError, match="drafters only"):
        Engine(EngineConfig(model="smollm2-135m", dtype="int8"))
    with pytest.raises(ValueError, match="CPU only"):
        ModelRunner.load("smollm2-135m", dtype="int8", device="cuda")
