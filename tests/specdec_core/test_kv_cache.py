"""The engine-owned slot cache on tiny random models: batched rows equal the model's own greedy `generate`,
rollback is a length change, rows move when others retire, sliding-window layers (Gemma3) are masked right."""

import pytest
import torch

from specdec_core.drafters.base import Draft, Drafter, NoDrafter
from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.drafters.draft_model import DraftModelDrafter, DraftModelPool
from specdec_core.loop import batch_decode
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.kv_cache import SlotKVCache
from specdec_core.loop.requests import DecodeParams
from specdec_core.model.attention_masks import attention_masks
from specdec_core.model.model_runner import UnsupportedArchitectureError, check_servable
from specdec_core.model.step_batch import StepBatch
from tests.tiny_models import hf_greedy, repetitive_prompt, tiny_gemma3, tiny_llama

LENGTHS = [5, 23, 11, 40, 17]


def decode_all(runner, prompts, new_tokens, batch_size, make_drafter=NoDrafter, max_new=None, **decoder_options):
    decoder = BatchDecoder(runner, max_batch=batch_size, **decoder_options)
    for key, prompt in enumerate(prompts):
        limit = (max_new or {}).get(key, new_tokens)
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=limit), make_drafter()))
    results = dict((request.key, result) for request, result in decoder.run())
    return [results[k] for k in range(len(prompts))], decoder


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_mask_follows_the_worked_example():
    """attention_masks' docstring: lengths [3, 1], T = 2, chain."""
    from transformers import LlamaConfig

    lengths = torch.tensor([3, 1])
    positions = lengths[:, None] + torch.arange(2)
    visible = torch.ones(2, 2, dtype=torch.bool).tril()[None].expand(2, 2, 2)
    mask = attention_masks(LlamaConfig(), lengths, positions, visible, kv_len=5, dtype=torch.float32)
    allowed = (mask[:, 0] == 0).int().tolist()  # [b, T, L]
    assert allowed[0] == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert allowed[1] == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_ar_equals_hf_greedy_per_row(llama, batch_size):
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate(LENGTHS)]
    results, _ = decode_all(llama, prompts, 12, batch_size)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(llama, prompt, 12)


def test_copy_drafts_late_admission_and_early_finish_stay_exact(llama):
    """5 requests through 2 slots (3 admitted late), two rows stop early, copy drafts of every length."""
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate(LENGTHS)]
    limits = {1: 3, 3: 6}
    results, decoder = decode_all(llama, prompts, 14, 2, lambda: CopySpecDrafter(gamma=2, copy_tokens=6), limits)
    for key, (prompt, result) in enumerate(zip(prompts, results)):
        assert result.token_ids == hf_greedy(llama, prompt, limits.get(key, 14))
    assert decoder.stats.drafted_tokens > 0 and decoder.stats.peak_rows == 2
    assert decoder.cache.lengths == []  # every slot freed


def test_tree_drafts_stay_exact(llama):
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate(LENGTHS)]
    results, decoder = decode_all(llama, prompts, 14, 3, lambda: CopySpecDrafter(gamma=1, copy_tokens=5,
                                                                                   candidates=3))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(llama, prompt, 14)
    assert decoder.stats.drafted_tokens > 0


class JunkDrafter(Drafter):
    """Proposes the target's next token, then junk: every step accepts exactly 1 and rejects the rest."""

    def __init__(self, runner, junk):
        self.runner, self.junk = runner, junk

    def propose(self, tokens, max_tokens):
        right = int(self.runner.forward(self.runner.new_cache(), list(tokens), 1).logits[0].argmax())
        return Draft(tokens=([right] + self.junk)[:max_tokens], source="junk")


def test_rollback_leaves_each_row_as_a_fresh_forward_would(llama):
    """After mixed accept/reject steps, each row's next logits from the slot cache equal a fresh forward."""
    decoder = BatchDecoder(llama, max_batch=3)
    decoder.budget.enabled = False  # verify every junk token: rejections are the point
    junk = [[7, 8, 9], [], [5]]
    for key, n in enumerate([9, 30, 15]):
        drafter = JunkDrafter(llama, junk[key]) if junk[key] else NoDrafter()
        decoder.submit(DecodeRequest(key, repetitive_prompt(key, n), DecodeParams(max_new_tokens=40), drafter))
    decoder.admit()
    for _ in range(4):
        decoder.step()
    for index, row in enumerate(decoder.rows):
        assert decoder.cache.lengths[index] == len(row.state.tokens) - 1
    assert decoder.rows[0].state.metrics.accepted_tokens == 4 and decoder.rows[0].state.metrics.drafted_tokens == 16
    # One more forward of each row's pending token, nothing committed.
    pending = torch.tensor([[row.state.tokens[-1]] for row in decoder.rows])
    lengths = torch.tensor(decoder.cache.lengths)
    logits = llama.forward_slots(decoder.cache, StepBatch(pending, lengths[:, None], torch.ones(3, 1, 1, dtype=torch.bool),
                                 torch.tensor([[b, 0] for b in range(3)])))
    for b, row in enumerate(decoder.rows):
        fresh = llama.forward(llama.new_cache(), row.state.tokens, 1).logits[0]
        assert torch.allclose(logits[b], fresh, atol=1e-4), (logits[b] - fresh).abs().max()


def test_retiring_a_row_moves_the_last_row_into_its_slot():
    cache = SlotKVCache(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    cache.fit(3, 8)
    for row, value in enumerate([1.0, 2.0, 3.0]):
        cache.add_row()
        cache.keys[0][row, :, :4] = value
        cache.set_length(row, 4)
    assert cache.remove_row(0) == 2
    assert cache.lengths == [4, 4] and float(cache.keys[0][0, 0, 0, 0]) == 3.0
    assert cache.remove_row(1) is None and cache.lengths == [4]


def test_moving_several_rows_paths_at_once_equals_moving_each_alone():
    """cache.move copies every row's accepted path in one gather and scatter, over every layer, keys and values;
    a path whose source and target overlap reads the positions as they were before the move."""
    def filled():
        cache = SlotKVCache(num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
        cache.fit(3, 16)
        for _ in range(3):
            cache.add_row()
        torch.manual_seed(0)
        cache.storage.copy_(torch.randn_like(cache.storage))
        return cache

    paths = [(0, [5, 7, 9], [4, 5, 6]), (2, [3, 4], [1, 2]), (1, [10], [2])]
    together, alone = filled(), filled()
    together.move(paths)
    for path in paths:
        alone.move([path])
    assert torch.equal(together.storage, alone.storage)
    before = filled()
    for layer in range(3):
        for buffers, old in ((together.keys, before.keys), (together.values, before.values)):
            assert torch.equal(buffers[layer][0, :, [4, 5, 6]], old[layer][0, :, [5, 7, 9]])  # overlap: 5 read first
            assert torch.equal(buffers[layer][2, :, [1, 2]], old[layer][2, :, [3, 4]])
            assert torch.equal(buffers[layer][1, :, 3:], old[layer][1, :, 3:])  # nothing else of row 1 moved


def test_cache_memory_follows_live_rows_and_budget_refuses_a_row_that_cannot_fit(llama):
    decoder = BatchDecoder(llama, max_batch=4, cache_budget_bytes=20_000)
    decoder.submit(DecodeRequest("big", list(range(1, 60)), DecodeParams(max_new_tokens=8), NoDrafter()))
    decoder.submit(DecodeRequest("ok", [1, 2, 3], DecodeParams(max_new_tokens=4), NoDrafter()))
    decoder.cache_budget_bytes = decoder.cache.bytes_for(1, 256)  # one row of one quantum fits, no more
    results = {request.key: result for request, result in decoder.run()}
    assert isinstance(results["big"], str) is False and len(results["big"].token_ids) == 8
    assert len(results["ok"].token_ids) == 4
    assert decoder.stats.peak_rows == 1  # the second row waited for the first to retire
    decoder.cache_budget_bytes = 1000
    decoder.submit(DecodeRequest("huge", list(range(1, 60)), DecodeParams(max_new_tokens=8), NoDrafter()))
    [(request, result)] = list(decoder.run())
    assert isinstance(result, str) and result.startswith("KVCacheBudgetError")


def test_requests_admitted_together_fit_the_cache_once(llama, monkeypatch):
    """8 requests into 8 free slots: one allocation for all of them, not one per admission (each copied every
    live row's keys); a later admission into freed slots needs none."""
    allocations = []
    original = SlotKVCache._allocate
    monkeypatch.setattr(SlotKVCache, "_allocate", lambda self, *a: (allocations.append(a), original(self, *a))[1])
    prompts = [repetitive_prompt(seed, 20 + seed) for seed in range(10)]
    results, decoder = decode_all(llama, prompts, 6, 8, max_new={0: 2, 1: 2})
    assert [len(r.token_ids) for r in results] == [2, 2] + [6] * 8
    grown = [a for a in allocations if a[0] > 0]
    assert len(grown) == 1 and grown[0][0] == 8, allocations  # rows 9 and 10 took the slots rows 0 and 1 freed
    for prompt, result in zip(prompts[2:], results[2:]):
        assert result.token_ids == hf_greedy(llama, prompt, 6)


def test_the_cache_is_sized_for_every_waiting_request_where_the_budget_allows(llama, monkeypatch):
    """Rows that retire one at a time are replaced one at a time, and each longer prompt from the sorted queue
    reallocated (and copied) the whole cache: the first admission now fits it for every waiting request, so its
    positions never grow again, where a look at the next max_batch requests (20 and 60 tokens admitted, 100 and
    120 next) grew it again for the 300- and 400-token prompts. A prompt over the model's context (refused at
    admission, an error row) reserves nothing. A budget that cannot hold that keeps the fit to the rows admitted
    (the later requests then wait for room, as before); the tokens are the same either way."""
    allocations = []
    original = SlotKVCache._allocate
    monkeypatch.setattr(SlotKVCache, "_allocate", lambda self, *a: (allocations.append(a), original(self, *a))[1])
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate((20, 60, 100, 120, 300, 400))]
    max_new = {0: 2, 1: 8, 2: 4, 3: 7, 4: 6, 5: 6}  # rows retire one at a time
    overlong = repetitive_prompt(9, llama.max_positions + 10)
    results, decoder = decode_all(llama, prompts + [overlong], 6, 2, max_new=max_new)
    grown = [a for a in allocations if a[0] > 0]
    # 400 + 6 new tokens + the step's draft slack, in whole quanta (the overlong prompt would have asked for 768);
    # later only the slots change, as the tail's rows retire
    assert grown[0] == (2, 512) and {capacity for _, capacity in grown} == {512}, allocations
    expected = [hf_greedy(llama, prompt, max_new[key]) for key, prompt in enumerate(prompts)]
    assert [r.token_ids for r in results[:-1]] == expected
    assert isinstance(results[-1], str) and results[-1].startswith("BadRequestError"), results[-1]

    allocations.clear()
    results, _ = decode_all(llama, prompts, 6, 2, max_new=max_new, cache_budget_bytes=decoder.cache.bytes_for(2, 256))
    assert [a for a in allocations if a[0] > 0][0] == (2, 256), allocations  # no room to look ahead
    assert [r.token_ids for r in results] == expected


def test_a_free_slot_waits_for_a_row_about_to_retire_so_one_prefill_fills_both(llama, monkeypatch):
    """Rows that retire a step apart used to be replaced by a prefill forward each; a free slot now waits (at most
    admit_wait steps) for a live row that will surely retire by then, and both slots fill in one forward. No wait
    for a row that may not retire in time, nor when the queue fits the free slots; the tokens are the same."""
    forwards = []
    original = BatchDecoder._prefill_forward
    monkeypatch.setattr(BatchDecoder, "_prefill_forward",
                        lambda self, group, chunks: (forwards.append(len(group)), original(self, group, chunks))[1])
    prompts = [repetitive_prompt(seed, 20) for seed in range(5)]
    max_new = {0: 3, 1: 4, 2: 6, 3: 6, 4: 6}  # rows 0 and 1 retire a step apart
    expected = [hf_greedy(llama, prompt, max_new[key]) for key, prompt in enumerate(prompts)]
    groups = {}
    for wait in (0, 2):
        forwards.clear()
        monkeypatch.setattr(batch_decode, "ADMIT_WAIT_STEPS", wait)
        results, _ = decode_all(llama, prompts, 6, 2, max_new=max_new)
        assert [r.token_ids for r in results] == expected
        groups[wait] = list(forwards)
    assert groups[0] == [2, 1, 1, 1], groups  # prompts 2, 3, 4: one forward each as the slots free
    assert groups[2] == [2, 2, 1], groups  # prompts 2 and 3 together; 4 alone (the queue then fits its slot)

class EchoDrafter(Drafter):
    """Always proposes the last 6 tokens again (a draft on every step, accepted or not)."""

    def propose(self, tokens, max_tokens):
        return Draft(tokens=list(tokens[-6:])[:max_tokens], source="echo")


class BookkeepingDrafter(EchoDrafter):
    """Echoes, and keeps bookkeeping while the target verifies: how far behind the row's tokens it is when asked
    to propose, and how often the loop ran it."""

    works_while_verifying = True

    def start(self, tokens, request):
        super().start(tokens, request)
        self.indexed, self.calls, self.behind = len(tokens), 0, []

    def propose(self, tokens, max_tokens):
        self.behind.append(len(tokens) - self.indexed)
        return super().propose(tokens, max_tokens)

    def while_verifying(self, tokens):
        self.calls += 1
        self.indexed = len(tokens)


def test_bookkeeping_waits_while_drafting_rests_and_catches_up_before_the_next_proposal(llama):
    """A budget that refuses every draft rests after rest_after steps (its rows propose nothing until the next
    exploring step): the drafters' while_verifying bookkeeping is put off for those steps too, and done before
    the row next proposes, so no proposal sees less than before (at most the last step's tokens unindexed)."""
    from specdec_core.loop.speculation_budget import SpeculationBudget, StepCostModel

    prompts = [repetitive_prompt(seed, 30) for seed in range(2)]
    budget = SpeculationBudget.for_target(llama, cost=StepCostModel(fixed=lambda rows, width: float(width)))
    decoder = BatchDecoder(llama, max_batch=2, budget=budget)
    drafters = [BookkeepingDrafter() for _ in prompts]
    for key, (prompt, drafter) in enumerate(zip(prompts, drafters)):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=40), drafter))
    results = dict((request.key, result) for request, result in decoder.run())
    assert [results[k].token_ids for k in range(2)] == [hf_greedy(llama, p, 40) for p in prompts]
    for drafter in drafters:
        assert drafter.behind and max(drafter.behind) <= 2  # an exploring step emits at most 2 tokens a row
        assert drafter.calls < decoder.stats.steps - 20  # of ~38 steps, 4 + 1 in 16 drafted or were next to
        assert 0 in drafter.behind  # a catch-up just before a proposal


@pytest.mark.parametrize("drafter", ["echo", "draft model"])
def test_a_seeded_sampling_row_verifies_its_own_drafts_whatever_the_budget_and_its_neighbours(llama, drafter):
    """A seeded row's drafts bypass the budget, whose choices follow the clock (capped only by the token budget over
    a full batch): its forwards' widths then do not change run after run, which in bf16, where a token's logits
    change with its step's width, keeps its draws the same. A budget that never drafts (and so rests) and one that
    always drafts, alone and beside greedy rows, give it the same tokens."""
    from specdec_core.loop.sampling import SamplingParams
    from specdec_core.loop.speculation_budget import SpeculationBudget, StepCostModel

    prompt = repetitive_prompt(3, 30)
    sampled = DecodeParams(max_new_tokens=24, sampling=SamplingParams(temperature=0.8, seed=11))
    outputs, drafted = [], []
    for cost, neighbours in ((lambda rows, width: float(width), 0), (lambda rows, width: 1.0, 2)):
        budget = SpeculationBudget.for_target(llama, cost=StepCostModel(fixed=cost), token_budget=15)
        decoder = BatchDecoder(llama, max_batch=3, budget=budget)
        own = EchoDrafter() if drafter == "echo" else DraftModelDrafter(DraftModelPool(tiny_llama(1)), num_tokens=6)
        decoder.submit(DecodeRequest("seeded", prompt, sampled, own))
        for key in range(neighbours):
            decoder.submit(DecodeRequest(key, repetitive_prompt(key, 17), DecodeParams(max_new_tokens=24),
                                         CopySpecDrafter(gamma=2, copy_tokens=8)))
        results = {request.key: result for request, result in decoder.run()}
        seeded = results["seeded"]
        assert seeded.metrics.drafted_tokens > 0 and len(seeded.token_ids) == 24
        assert seeded.metrics.drafted_tokens <= 4 * seeded.metrics.target_forwards  # 15 // 3 - 1 per step
        outputs.append(seeded.token_ids)
        drafted.append(seeded.metrics.drafted_tokens)
    assert outputs[0] == outputs[1] and drafted[0] == drafted[1]  # the budget changed none of its widths


class StallingDrafter(Drafter):
    """Sleeps in every proposal: a row stuck this way must time out without holding its neighbours back."""

    def propose(self, tokens, max_tokens):
        import time

        time.sleep(0.05)
        return Draft(tokens=[], source="stall")


def test_a_row_past_its_timeout_retires_with_an_error_and_frees_its_slot(llama):
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate(LENGTHS[:3])]
    decoder = BatchDecoder(llama, max_batch=2, row_timeout_s=1.5)
    decoder.submit(DecodeRequest("stuck", prompts[0], DecodeParams(max_new_tokens=400), StallingDrafter()))
    for key in (1, 2):
        decoder.submit(DecodeRequest(key, prompts[key], DecodeParams(max_new_tokens=6), NoDrafter()))
    results = {request.key: result for request, result in decoder.run()}
    assert isinstance(results["stuck"], str) and results["stuck"].startswith("RowTimeoutError"), results["stuck"]
    for key in (1, 2):  # the row admitted after "stuck" timed out got its slot and the right tokens
        assert results[key].token_ids == hf_greedy(llama, prompts[key], 6)
    with pytest.raises(ValueError, match="row timeout"):
        BatchDecoder(llama, row_timeout_s=0)


def test_gemma3_sliding_window_rows_equal_hf_greedy():
    """Prompts longer than the window (8) in one batch with copy drafts: every row equals Gemma3's own generate."""
    gemma = tiny_gemma3()
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate([20, 33, 12])]
    results, decoder = decode_all(gemma, prompts, 16, 3, lambda: CopySpecDrafter(gamma=2, copy_tokens=4))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(gemma, prompt, 16)


def test_an_architecture_the_cache_cannot_serve_is_one_clear_error():
    from transformers import Qwen2Config

    config = Qwen2Config(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2)
    with pytest.raises(UnsupportedArchitectureError, match="cannot serve"):
        check_servable(config)
