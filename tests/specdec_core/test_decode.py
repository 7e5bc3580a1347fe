"""The decode loop on the real default model: KV rollback, stop conditions, metric definitions, seeded sampling."""

import pytest
import torch

from specdec_core.decode import DecodeParams, decode, prefill, speculative_step
from specdec_core.drafters.base import Draft, Drafter, NoDrafter, RequestContext
from specdec_core.drafters.draft_model import DraftModelDrafter
from specdec_core.errors import BadRequestError
from specdec_core.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]


class JunkDrafter(Drafter):
    """Proposes the target's own next token followed by junk, so every step accepts 1 and rejects the rest."""

    def __init__(self, target):
        self.target = target

    def propose(self, tokens, max_tokens):
        cache = self.target.new_cache()
        right = int(self.target.forward(cache, list(tokens), 1).logits[0].argmax())
        return Draft(tokens=([right] + [17, 4242, 99, 5])[:max_tokens], source="junk")


def test_kv_rollback_matches_fresh_forward(engine):
    target = engine.target
    ids = engine.prompt_ids(messages=PROMPT)
    params = DecodeParams(max_new_tokens=64)
    state = prefill(target, ids, params)
    drafter = JunkDrafter(target)
    for _ in range(3):
        speculative_step(target, drafter, state, params)
    assert state.metrics.accepted_tokens == 3 and state.metrics.drafted_tokens == 15
    assert state.cache.get_seq_length() == len(state.tokens) - 1
    # Next logits from the rolled-back cache == a fresh forward over the accepted sequence.
    rolled = target.forward(state.cache, [state.tokens[-1]], 1).logits[0]
    fresh = target.forward(target.new_cache(), state.tokens, 1).logits[0]
    assert torch.allclose(rolled, fresh, atol=1e-4), (rolled - fresh).abs().max()
    assert rolled.argmax() == fresh.argmax()


def test_draft_model_cache_follows_accepted_tokens_after_rejections(engine):
    ids = engine.prompt_ids(messages=PROMPT)
    params = DecodeParams(max_new_tokens=40)
    state = prefill(engine.target, ids, params)
    request = RequestContext(prompt_len=len(ids), sampling=params.sampling, generator=state.generator)
    drafter = DraftModelDrafter(engine.draft_model, num_tokens=4)
    drafter.start(state.tokens, request)
    for _ in range(4):
        speculative_step(engine.target, drafter, state, params)
    fresh = DraftModelDrafter(engine.draft_model, num_tokens=4)
    fresh.start(state.tokens, request)
    assert drafter.propose(state.tokens, 4).tokens == fresh.propose(state.tokens, 4).tokens
    assert drafter.cache.get_seq_length() == len(state.tokens) + 3  # history + 3 fed draft tokens


def test_metrics_follow_their_definitions(engine):
    r = engine.generate(messages=PROMPT, method="copyspec", params=DecodeParams(max_new_tokens=80))
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
        r = engine.generate(messages=PROMPT, method=method, params=DecodeParams(max_new_tokens=7))
        assert r["new_tokens"] == 7 and r["finish_reason"] == "length"
        assert r["drafted_tokens"] <= 6 * r["target_forwards"]


def test_stop_string_cuts_text(engine):
    ar = engine.generate(messages=PROMPT, method="ar", params=DecodeParams(max_new_tokens=60))
    stop = ar["output_text"][20:26]
    r = engine.generate(messages=PROMPT, method="copyspec", params=DecodeParams(max_new_tokens=60, stop_strings=(stop,)))
    assert r["finish_reason"] == "stop"
    assert r["output_text"] == ar["output_text"][: ar["output_text"].find(stop)]
    assert r["new_tokens"] < ar["new_tokens"]
    # Ids stop at the token that completed the stop string, even when a long copied draft went past it.
    ids = r["output_token_ids"]
    assert ids == ar["output_token_ids"][: len(ids)]
    assert stop in engine.tokenizer.decode(ids) and stop not in engine.tokenizer.decode(ids[:-1])


def test_context_limit_stops_generation(engine, monkeypatch):
    ids = engine.prompt_ids(messages=PROMPT)
    monkeypatch.setattr(engine.target, "max_positions", len(ids) + 9)
    r = engine.generate_ids(ids, "copyspec", DecodeParams(max_new_tokens=100))
    assert r["finish_reason"] == "length" and len(ids) + r["new_tokens"] == len(ids) + 9
    with pytest.raises(BadRequestError, match="context limit"):
        engine.generate_ids(ids + ids, "ar", DecodeParams(max_new_tokens=5))


def test_empty_prompt_is_a_clear_error(engine):
    with pytest.raises(BadRequestError, match="empty prompt"):
        decode(engine.target, NoDrafter(), [], DecodeParams())
    with pytest.raises(BadRequestError, match="empty prompt"):
        engine.generate(prompt="   ")


@pytest.mark.parametrize("method", ["ar", "copyspec", "draft"])
def test_seeded_sampling_is_reproducible(engine, method):
    params = DecodeParams(max_new_tokens=48, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7))
    first = engine.generate(messages=PROMPT, method=method, params=params)
    second = engine.generate(messages=PROMPT, method=method, params=params)
    assert first["output_token_ids"] == second["output_token_ids"]
    other = engine.generate(
        messages=PROMPT, method=method,
        params=DecodeParams(max_new_tokens=48, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=8)),
    )
    assert other["output_token_ids"] != first["output_token_ids"]
