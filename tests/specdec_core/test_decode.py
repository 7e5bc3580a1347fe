"""The decode loop on a tiny random Llama (fp32), through the engine's public calls: the pooled draft model's cache
after rejections, stop conditions, metric definitions, seeded sampling. (Rollback against a fresh forward is
test_kv_cache.py's; every method on the real model is test_lossless.py's.)"""

import pytest
import torch

from specdec_core.drafters.base import RequestContext
from specdec_core.drafters.draft_model import DraftModelDrafter, DraftModelPool
from specdec_core.engine import BatchItem, Engine
from specdec_core.errors import BadRequestError
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.sampling import SamplingParams
from tests.tiny_models import noisy_llama, repetitive_prompt, tiny_llama

PROMPT = repetitive_prompt(0, 40)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_runners(tiny_llama(0), noisy_llama())


def test_draft_model_cache_follows_accepted_tokens_after_rejections(engine):
    """The pooled draft model drafts what a fresh drafter would, after rejections rolled its slot back."""
    ids = PROMPT
    pool = DraftModelPool(engine.draft_model)
    decoder = BatchDecoder(engine.target, max_batch=1)
    decoder.budget.enabled = False
    drafter = DraftModelDrafter(pool, num_tokens=4)
    decoder.submit(DecodeRequest(0, ids, DecodeParams(max_new_tokens=40), drafter))
    decoder.admit()
    for _ in range(4):
        decoder.step()
    state = decoder.rows[0].state
    assert state.metrics.drafted_tokens == 16
    first = drafter.propose(state.tokens, 4).tokens
    assert drafter.cache_length == len(state.tokens) + 3  # history + 3 fed draft tokens
    # The target accepts the first drafted token and rejects the second, emitting another token instead.
    replacement = first[1] % 90 + 1  # any other token of the vocabulary
    accepted = list(state.tokens) + [first[0], replacement]
    request = RequestContext(prompt_len=len(ids), sampling=DecodeParams().sampling, generator=state.generator)
    fresh = DraftModelDrafter(engine.draft_model, num_tokens=4)
    fresh.start(accepted, request)
    assert drafter.propose(accepted, 4).tokens == fresh.propose(accepted, 4).tokens
    assert drafter.cache_length == len(accepted) + 3


def test_a_pooled_draft_model_drafts_no_further_than_the_plan_verifies(engine):
    """The step is planned before the draft model runs (each drafted token is one of its forwards): with a plan
    that verifies at most 2 tokens, a drafter asking for 6 drafts 2, its length does not grow on drafts the plan
    cut, and the output is still ar's."""
    from specdec_core.loop.speculation_budget import SpeculationBudget

    ids = PROMPT
    plain = engine.generate_ids(ids, "ar", DecodeParams(max_new_tokens=24))
    decoder = BatchDecoder(engine.target, max_batch=1, budget=SpeculationBudget(enabled=False, token_budget=3))
    drafter = DraftModelDrafter(DraftModelPool(engine.draft_model), num_tokens=6, adaptive=True)
    decoder.submit(DecodeRequest(0, ids, DecodeParams(max_new_tokens=24), drafter))
    [(_, result)] = list(decoder.run())
    assert result.token_ids == plain["output_token_ids"]
    assert decoder.stats.verified_tokens > 0
    assert decoder.stats.drafted_tokens == decoder.stats.verified_tokens  # nothing drafted that was not verified
    assert decoder.stats.verified_tokens <= 2 * decoder.stats.steps
    assert drafter.length.current <= 6


def test_metrics_follow_their_definitions(engine):
    r = engine.generate_ids(PROMPT, method="copyspec", params=DecodeParams(max_new_tokens=80))
    assert r["new_tokens"] == len(r["output_token_ids"]) <= 80
    assert r["mean_accepted_length"] == pytest.approx(r["new_tokens"] / r["target_forwards"])
    assert r["acceptance_rate"] == pytest.approx(r["accepted_tokens"] / r["drafted_tokens"])
    assert sum(r["accepted_by_source"].values()) == r["new_tokens"]
    assert r["accepted_by_source"].get("copy", 0) == r["copied_tokens"] == r["accepted_tokens"]
    assert r["tpot_s"] == pytest.approx((r["wall_s"] - r["ttft_s"]) / (r["new_tokens"] - 1))
    assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"])
    assert 0 < r["ttft_s"] < r["wall_s"]


def test_max_new_tokens_is_exact_and_never_overdrafted(engine):
    for method in ("ar", "copyspec", "draft"):
        r = engine.generate_ids(PROMPT, method=method, params=DecodeParams(max_new_tokens=7))
        assert r["new_tokens"] == 7 and r["finish_reason"] == "length"
        assert r["drafted_tokens"] <= 6 * r["target_forwards"]


def test_stop_string_cuts_text(engine):
    ar = engine.generate_ids(PROMPT, method="ar", params=DecodeParams(max_new_tokens=60))
    stop = ar["output_text"][20:26]
    r = engine.generate_ids(PROMPT, method="copyspec", params=DecodeParams(max_new_tokens=60, stop_strings=(stop,)))
    assert r["finish_reason"] == "stop"
    assert r["output_text"] == ar["output_text"][: ar["output_text"].find(stop)]
    assert r["new_tokens"] < ar["new_tokens"]
    # Ids stop at the token that completed the stop string, even when a long copied draft went past it.
    ids = r["output_token_ids"]
    assert ids == ar["output_token_ids"][: len(ids)]
    assert stop in engine.tokenizer.decode(ids) and stop not in engine.tokenizer.decode(ids[:-1])


def test_context_limit_stops_generation(engine, monkeypatch):
    ids = PROMPT
    monkeypatch.setattr(engine.target, "max_positions", len(ids) + 9)
    r = engine.generate_ids(ids, "copyspec", DecodeParams(max_new_tokens=100))
    assert r["finish_reason"] == "length" and len(ids) + r["new_tokens"] == len(ids) + 9
    with pytest.raises(BadRequestError, match="context limit"):
        engine.generate_ids(ids + ids, "ar", DecodeParams(max_new_tokens=5))


def test_empty_prompt_is_a_clear_error(engine):
    for method in ("ar", "copyspec"):
        with pytest.raises(BadRequestError, match="empty prompt"):
            engine.generate_ids([], method)


@pytest.mark.parametrize("method", ["ar", "copyspec", "draft"])
def test_seeded_sampling_is_reproducible(engine, method):
    params = DecodeParams(max_new_tokens=48, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7))
    first = engine.generate_ids(PROMPT, method=method, params=params)
    second = engine.generate_ids(PROMPT, method=method, params=params)
    assert first["output_token_ids"] == second["output_token_ids"]
    other = engine.generate_ids(
        PROMPT, method=method,
        params=DecodeParams(max_new_tokens=48, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=8)),
    )
    assert other["output_token_ids"] != first["output_token_ids"]


@pytest.mark.parametrize("method", ["ar", "copyspec"])
def test_seeded_row_samples_the_same_alone_and_inside_a_batch(engine, method):
    """Each row samples with its own generator: its neighbours in the batch do not change what it draws."""
    sampled = DecodeParams(max_new_tokens=32, sampling=SamplingParams(temperature=0.8, seed=3))
    target = BatchItem("seeded", PROMPT, sampled)
    others = [BatchItem(i, prompt, DecodeParams(max_new_tokens=40, sampling=SamplingParams(temperature=1.0, seed=i)))
              for i, prompt in enumerate([[5, 9, 14], repetitive_prompt(1, 60)])]
    alone = dict(engine.decode_batch([target], method, batch_size=1))["seeded"]
    together = dict(engine.decode_batch([others[0], target, others[1]], method, batch_size=3))["seeded"]
    assert alone["output_token_ids"] == together["output_token_ids"]


@pytest.fixture(scope="module")
def peaked_engine():
    """A target whose next-token distributions are peaked (its head scaled up), as a trained model's are: a sampled
    row then repeats itself, so copy drafts get accepted under sampling too."""
    runner = tiny_llama(0)
    with torch.no_grad():
        runner.model.lm_head.weight.mul_(20.0)
    return Engine.from_runners(runner)


def test_one_hot_speculative_sampling_draws_what_ar_draws(peaked_engine):
    """One draw per emitted token (verification.py): with the same seed, copyspec samples ar's very tokens (fp32),
    although it verifies several tokens per step; the draws stay aligned with positions."""
    params = DecodeParams(max_new_tokens=40, sampling=SamplingParams(temperature=0.8, seed=11))
    ar = peaked_engine.generate_ids(PROMPT, method="ar", params=params)
    copy = peaked_engine.generate_ids(PROMPT, method="copyspec", params=params)
    assert copy["accepted_tokens"] > 0, "nothing was drafted and accepted: the test proved nothing"
    assert copy["output_token_ids"] == ar["output_token_ids"]


def test_a_drafter_learns_at_start_how_many_tokens_its_row_may_still_add(engine):
    """RequestContext.tokens_left: max_new_tokens less the prefill's token, or less where the context limit ends
    the row first (what a drafter's index sizes itself for)."""
    from specdec_core.drafters.prompt_lookup import PromptLookupDrafter

    class Recording(PromptLookupDrafter):
        def start(self, tokens, request):
            super().start(tokens, request)
            seen.append((len(tokens), request.tokens_left))

    seen: list = []
    limit = engine.target.max_positions
    decoder = BatchDecoder(engine.target, max_batch=2)
    decoder.submit(DecodeRequest(0, PROMPT, DecodeParams(max_new_tokens=12), Recording()))
    long_prompt = repetitive_prompt(1, limit - 5)
    decoder.submit(DecodeRequest(1, long_prompt, DecodeParams(max_new_tokens=12), Recording()))
    list(decoder.run())
    assert sorted(seen) == [(len(PROMPT) + 1, 11), (limit - 4, 4)]
