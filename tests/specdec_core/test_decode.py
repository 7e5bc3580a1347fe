"""The decode loop on the real default model: KV rollback, stop conditions, metric definitions, seeded sampling."""

import pytest
import torch

from specdec_core.batch_decode import BatchDecoder, DecodeRequest, decode
from specdec_core.decode import DecodeParams
from specdec_core.drafters.base import Draft, Drafter, NoDrafter, RequestContext
from specdec_core.drafters.draft_model import DraftModelDrafter, DraftModelPool
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
    """Real model, batch of two: after rejected junk drafts each row's next logits equal a fresh forward."""
    target = engine.target
    decoder = BatchDecoder(target, max_batch=2)
    decoder.budget.enabled = False  # verify every junk token
    decoder.submit(DecodeRequest(0, engine.prompt_ids(messages=PROMPT), DecodeParams(max_new_tokens=64),
                                 JunkDrafter(target)))
    decoder.submit(DecodeRequest(1, engine.prompt_ids(prompt="Count from one to ten."),
                                 DecodeParams(max_new_tokens=64), NoDrafter()))
    decoder.admit()
    for _ in range(3):
        decoder.step()
    junk_row = decoder.rows[0].state
    assert junk_row.metrics.accepted_tokens == 3 and junk_row.metrics.drafted_tokens == 15
    pending = torch.tensor([[row.state.tokens[-1]] for row in decoder.rows])
    lengths = torch.tensor(decoder.cache.lengths)
    assert lengths.tolist() == [len(row.state.tokens) - 1 for row in decoder.rows]
    rolled = target.forward_slots(decoder.cache, pending, lengths[:, None], torch.ones(2, 1, 1, dtype=torch.bool),
                                  torch.tensor([[0, 0], [1, 0]]))
    for b, row in enumerate(decoder.rows):
        fresh = target.forward(target.new_cache(), row.state.tokens, 1).logits[0]
        assert torch.allclose(rolled[b], fresh, atol=1e-4), (rolled[b] - fresh).abs().max()
        assert rolled[b].argmax() == fresh.argmax()


def test_draft_model_cache_follows_accepted_tokens_after_rejections(engine):
    """The pooled draft model drafts what a fresh drafter would, after rejections rolled its slot back."""
    ids = engine.prompt_ids(messages=PROMPT)
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
    replacement = 1234 if first[1] != 1234 else 1235
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
    from specdec_core.speculation_budget import SpeculationBudget

    ids = engine.prompt_ids(messages=PROMPT)
    plain = decode(engine.target, NoDrafter(), ids, DecodeParams(max_new_tokens=24))
    decoder = BatchDecoder(engine.target, max_batch=1, budget=SpeculationBudget(enabled=False, token_budget=3))
    drafter = DraftModelDrafter(DraftModelPool(engine.draft_model), num_tokens=6, adaptive=True)
    decoder.submit(DecodeRequest(0, ids, DecodeParams(max_new_tokens=24), drafter))
    [(_, result)] = list(decoder.run())
    assert result.token_ids == plain.token_ids
    assert decoder.stats.verified_tokens > 0
    assert decoder.stats.drafted_tokens == decoder.stats.verified_tokens  # nothing drafted that was not verified
    assert decoder.stats.verified_tokens <= 2 * decoder.stats.steps
    assert drafter.length.current <= 6


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


@pytest.mark.parametrize("method", ["ar", "copyspec"])
def test_seeded_row_samples_the_same_alone_and_inside_a_batch(engine, method):
    """Each row samples with its own generator: its neighbours in the batch do not change what it draws."""
    from specdec_core.engine import BatchItem

    sampled = DecodeParams(max_new_tokens=32, sampling=SamplingParams(temperature=0.8, seed=3))
    target = BatchItem("seeded", engine.prompt_ids(messages=PROMPT), sampled)
    others = [BatchItem(i, engine.prompt_ids(prompt=text), DecodeParams(max_new_tokens=40, sampling=SamplingParams(
        temperature=1.0, seed=i))) for i, text in enumerate(["Name three colours.", "Describe a cat " * 20])]
    alone = dict(engine.decode_batch([target], method, batch_size=1))["seeded"]
    together = dict(engine.decode_batch([others[0], target, others[1]], method, batch_size=3))["seeded"]
    assert alone["output_token_ids"] == together["output_token_ids"]


def test_one_hot_speculative_sampling_draws_what_ar_draws(engine):
    """One draw per emitted token (verification.py): with the same seed, copyspec samples ar's very tokens (fp32),
    although it verifies several tokens per step; the draws stay aligned with positions."""
    params = DecodeParams(max_new_tokens=40, sampling=SamplingParams(temperature=0.8, seed=11))
    ar = engine.generate(messages=PROMPT, method="ar", params=params)
    copy = engine.generate(messages=PROMPT, method="copyspec", params=params)
    assert copy["accepted_tokens"] > 0, "nothing was drafted and accepted: the test proved nothing"
    assert copy["output_token_ids"] == ar["output_token_ids"]
