"""Shared, chunked prefill and the prefix cache on tiny random models (fp32): whatever the budget, chunking and
prefix hits, every row's tokens equal HF greedy's for its prompt alone; a row that breaks a shared prefill forward
fails alone."""

import pytest
import torch

from specdec_core.kernels import fp32_chain_attention
from specdec_core.drafters.base import NoDrafter
from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.drafters.pld_plus import HiddenStateLookupDrafter
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.kv_cache import new_slot_cache
from specdec_core.loop.prefill_plan import (
    GPU_PREFILL_TOKENS,
    MIN_HIT_SHARE,
    PREFILL_TOKENS,
    default_budget,
    next_forward,
    worth_reusing,
)
from specdec_core.loop.prefix_cache import PrefixCache
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.speculation_budget import SpeculationBudget
from tests.tiny_models import hf_greedy, repetitive_prompt, tiny_gemma3, tiny_llama

LENGTHS = [6, 41, 13, 60, 24, 9, 33, 18]
NEW = 12


def decode(runner, prompts, batch_size=8, prefill_tokens=512, prefix_cache=None, make_drafter=NoDrafter):
    # The speculation budget off: its plan follows the clock, and the PLD+ test compares accepted tokens.
    decoder = BatchDecoder(runner, max_batch=batch_size, budget=SpeculationBudget(enabled=False),
                           prefill_tokens=prefill_tokens, prefix_cache=prefix_cache)
    for key, prompt in enumerate(prompts):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=NEW), make_drafter()))
    got = {request.key: result for request, result in decoder.run()}
    return [got[key] for key in range(len(prompts))], decoder


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts():
    return [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def reference(llama, prompts):
    return [hf_greedy(llama, prompt, NEW) for prompt in prompts]


def test_the_plan_keeps_each_forward_within_the_budget():
    assert next_forward([5, 6, 7, 8], [0, 0, 0, 0], capacity=100, budget=16) == [5, 6]  # 3 x 7 > 16
    assert next_forward([40, 3], [0, 0], capacity=100, budget=16) == [16]  # a long prompt: one chunk, alone
    assert next_forward([3, 3], [90, 0], capacity=100, budget=16) == [3, 3]
    assert next_forward([3, 9], [90, 0], capacity=98, budget=16) == [3]  # row 0's padding would pass the capacity
    with pytest.raises(ValueError):
        next_forward([3], [0], capacity=10, budget=0)


@pytest.mark.parametrize("prefill_tokens", [1, 7, 64, 512])
def test_chunked_shared_prefill_equals_hf_greedy(llama, prompts, reference, prefill_tokens):
    results, decoder = decode(llama, prompts, prefill_tokens=prefill_tokens, prefix_cache=PrefixCache(0))
    assert [r.token_ids for r in results] == reference
    assert decoder.stats.prompt_tokens == sum(LENGTHS) and decoder.stats.prefix_hit_tokens == 0
    assert all(r.metrics.target_forwards == r.metrics.new_tokens for r in results)  # the prefill counts once


def test_sliding_window_rows_chunked_equal_hf_greedy():
    gemma = tiny_gemma3(window=8)
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate([30, 11, 19])]
    results, _ = decode(gemma, prompts, prefill_tokens=9)
    assert [r.token_ids for r in results] == [hf_greedy(gemma, prompt, NEW) for prompt in prompts]


def test_pld_plus_hidden_states_survive_chunking(llama, prompts):
    """PLD+ (h) reads the target's hidden state at every prompt position: handed over chunk by chunk, its drafts
    (and so its steps) are those of an unchunked prefill."""
    whole, _ = decode(llama, prompts, make_drafter=lambda: HiddenStateLookupDrafter(hidden_layer=1))
    chunked, decoder = decode(llama, prompts, prefill_tokens=5, make_drafter=lambda: HiddenStateLookupDrafter(hidden_layer=1))
    assert [r.token_ids for r in chunked] == [r.token_ids for r in whole]
    assert [r.metrics.accepted_tokens for r in chunked] == [r.metrics.accepted_tokens for r in whole]
    assert sum(r.metrics.accepted_tokens for r in chunked) > 0


def test_a_prefix_hit_gives_the_tokens_of_a_miss(llama, reference, prompts):
    shared = repetitive_prompt(99, 40)  # 2 whole blocks of 16, then each prompt's own tokens
    with_prefix = [shared + prompt for prompt in prompts]
    expected = [hf_greedy(llama, prompt, NEW) for prompt in with_prefix]
    store = PrefixCache()
    first, decoder = decode(llama, with_prefix[:1], prefix_cache=store)
    assert decoder.stats.prefix_hit_tokens == 0
    results, decoder = decode(llama, with_prefix, batch_size=3, prefill_tokens=20, prefix_cache=store)
    assert first[0].token_ids == expected[0]
    assert [r.token_ids for r in results] == expected
    assert decoder.stats.prefix_hit_tokens == 32 * len(prompts)
    assert decoder.stats.prefix_hit_rate == pytest.approx(32 * len(prompts) / sum(map(len, with_prefix)))


class RecordingHidden(HiddenStateLookupDrafter):
    """Keeps every state it is handed, in order."""

    def __init__(self):
        super().__init__(hidden_layer=1)
        self.seen = []

    def observe_hidden(self, hidden):
        self.seen.append(hidden.float().clone())
        super().observe_hidden(hidden)


def test_a_prefix_hit_hands_pld_plus_h_the_states_of_a_miss(llama, prompts):
    """PLD+ (h) reads the hidden state at every prompt position: a row takes only cached blocks that hold its
    layer's states too, and is handed them, so it sees the states a miss computes and drafts as a miss does."""
    shared = repetitive_prompt(97, 40)
    with_prefix = [shared + prompt for prompt in prompts]
    missing, hitting = [], []
    missed, _ = decode(llama, with_prefix, prefix_cache=PrefixCache(0),
                       make_drafter=lambda: missing.append(RecordingHidden()) or missing[-1])
    store = PrefixCache()
    decode(llama, with_prefix[:1], prefix_cache=store)  # plain rows store keys and values, no states
    _, decoder = decode(llama, with_prefix[:1], prefix_cache=store, make_drafter=RecordingHidden)
    assert decoder.stats.prefix_hit_tokens == 0  # the blocks lack layer 1's states: computed, and stored now
    hit, decoder = decode(llama, with_prefix, batch_size=3, prefix_cache=store,
                          make_drafter=lambda: hitting.append(RecordingHidden()) or hitting[-1])
    assert decoder.stats.prefix_hit_tokens == 32 * len(prompts)
    for got, expected in zip(hitting, missing):
        torch.testing.assert_close(torch.cat(got.seen), torch.cat(expected.seen), atol=1e-5, rtol=1e-5)
    assert [r.token_ids for r in hit] == [r.token_ids for r in missed]
    assert [r.metrics.accepted_tokens for r in hit] == [r.metrics.accepted_tokens for r in missed]
    assert sum(r.metrics.accepted_tokens for r in hit) > 0
    blocks = list(store._blocks.values())  # the states count in the store's bytes, and go with their blocks
    spans = {id(block.span): block.span for block in blocks}
    assert store.nbytes == sum(span.nbytes for span in spans.values()) + sum(b.hidden_bytes for b in blocks)
    assert all(block.hidden_bytes for block in blocks[:2])
    store.budget_bytes = 1
    store._evict()
    assert store.nbytes == 0 and not store._blocks


def test_a_row_reuses_the_prefix_of_a_row_fed_before_it_in_the_same_admission(llama, prompts):
    shared = repetitive_prompt(98, 40)
    pair = [shared + prompts[0], shared + prompts[3]]  # 46 and 100 tokens: two forwards under a budget of 64
    results, decoder = decode(llama, pair, prefill_tokens=64)
    assert decoder.stats.prefix_hit_tokens == 32
    assert [r.token_ids for r in results] == [hf_greedy(llama, prompt, NEW) for prompt in pair]


def test_a_prompt_that_is_all_cached_still_prefills_its_last_token(llama):
    prompt = repetitive_prompt(7, 32)  # exactly two blocks
    store = PrefixCache()
    decode(llama, [prompt], prefix_cache=store)
    results, decoder = decode(llama, [prompt, prompt], prefix_cache=store)
    assert decoder.stats.prefix_hit_tokens == 2 * 16  # the second block holds the last token: it is fed again
    assert [r.token_ids for r in results] == [hf_greedy(llama, prompt, NEW)] * 2


def test_the_store_stays_within_its_budget_and_forgets_a_chain_from_its_tail(llama):
    """A row's new blocks share one allocation (a span). Eviction takes the least recently used chain's blocks
    tail first; a span left half empty moves its live blocks to a smaller one, so the store's bytes are what it
    holds and a kept head block does not pin its whole span."""
    block_bytes = new_slot_cache(llama).bytes_for(1, 16)  # one row's keys and values over 16 positions
    store = PrefixCache(budget_bytes=3 * block_bytes)
    first, second = repetitive_prompt(1, 49), repetitive_prompt(2, 33)
    decode(llama, [first], prefix_cache=store)  # 3 blocks, one span
    assert store.nbytes == 3 * block_bytes and len(store.lookup(first)) == 3
    head = store.lookup(first)[0].keys.clone()
    decode(llama, [second], prefix_cache=store)  # 2 more blocks: the first chain's last two go
    assert store.nbytes == 3 * block_bytes
    assert len(store.lookup(second)) == 2 and len(store.lookup(first)) == 1
    assert torch.equal(store.lookup(first)[0].keys, head)  # (moved to a span of its own, unchanged)
    store.budget_bytes = 5 * block_bytes
    expected = hf_greedy(llama, first, NEW)
    results, decoder = decode(llama, [first], prefix_cache=store)  # the head hits, 2 blocks are stored again
    assert decoder.stats.prefix_hit_tokens == 16 and results[0].token_ids == expected
    assert store.nbytes == 5 * block_bytes


def test_a_row_that_breaks_a_shared_prefill_fails_alone(llama, prompts, reference, monkeypatch):
    poison = 7777  # outside the tiny vocabulary: the embedding lookup raises in any forward that feeds it
    bad = prompts[3][:20] + [poison] + prompts[3][20:]
    batch = prompts[:3] + [bad] + prompts[4:]
    results, _ = decode(llama, batch, prefill_tokens=200, prefix_cache=PrefixCache(0))
    assert isinstance(results[3], str) and "IndexError" in results[3]
    assert [r.token_ids for i, r in enumerate(results) if i != 3] == [ref for i, ref in enumerate(reference) if i != 3]


def test_copy_drafter_rows_after_a_prefix_hit_equal_hf_greedy(llama, prompts, reference):
    store = PrefixCache()
    decode(llama, prompts, prefix_cache=store, make_drafter=CopySpecDrafter)
    results, decoder = decode(llama, prompts, batch_size=3, prefix_cache=store, make_drafter=CopySpecDrafter)
    assert decoder.stats.prefix_hit_tokens > 0
    assert [r.token_ids for r in results] == reference


def test_prefill_budget_defaults_to_the_device(llama):
    """A CPU's prefill is compute-bound (1,024 padded tokens per forward suffice); a GPU's forward of that size is
    launch-bound, so it gets a budget that takes a whole batch of prompts in a few forwards."""
    assert BatchDecoder(llama).prefill_tokens == PREFILL_TOKENS
    assert default_budget("cuda:0") == default_budget("cuda") == GPU_PREFILL_TOKENS > 8 * PREFILL_TOKENS
    with pytest.raises(ValueError, match="prefill token budget"):
        BatchDecoder(llama, prefill_tokens=0)


def test_the_store_keeps_each_block_as_the_cache_holds_it_and_copies_it_back_exactly(llama):
    """Blocks are cut from one slice per layer (not one per block and layer); a chain whose middle block is missing
    stores just that block; copy_into writes every block back bit for bit."""
    prompt = repetitive_prompt(5, 70)  # 4 whole blocks
    cache = new_slot_cache(llama)
    cache.fit(2, 80)
    source, target = cache.add_row(), cache.add_row()
    generator = torch.Generator().manual_seed(0)
    for buffer in cache.keys + cache.values:
        buffer.copy_(torch.randn(buffer.shape, generator=generator))
    cache.set_length(source, len(prompt))
    store = PrefixCache()
    store.store(cache, source, prompt)
    stored = store.nbytes
    for key in list(store._blocks)[1::2]:  # blocks 1 and 3 go: storing again takes the non-contiguous path
        block = store._blocks.pop(key)
        block.span.blocks.remove(block)
    store.store(cache, source, prompt)
    assert store.nbytes == stored + stored // 2  # a new span of the 2 missing blocks
    blocks = store.lookup(prompt)
    assert len(blocks) == 4 and [block.span is blocks[0].span for block in blocks] == [True, False, True, False]

    def held(row, index):  # [layers, kv_heads, 16, head_dim] of block `index` in `row`
        span = slice(16 * index, 16 * index + 16)
        return (torch.stack([keys[row, :, span] for keys in cache.keys]),
                torch.stack([values[row, :, span] for values in cache.values]))

    assert all(torch.equal(block.keys, held(source, i)[0]) and torch.equal(block.values, held(source, i)[1])
               for i, block in enumerate(blocks))
    assert store.copy_into(cache, target, blocks) == 64 and cache.lengths[target] == 64
    assert all(torch.equal(block.keys, held(target, i)[0]) and torch.equal(block.values, held(target, i)[1])
               for i, block in enumerate(blocks))


def test_a_small_hit_on_a_prompt_fed_alone_is_skipped_for_the_unmasked_prefill(llama, monkeypatch):
    """Where prefills attend through SDPA (here: the fp32 prompt attention off), a prompt that fills its own forward
    prefills from position 0 without a mask (SDPA's causal kernel); a hit under MIN_HIT_SHARE of it would cost the
    mask more than it saves, so it is not used. Rows that share their forward are masked anyway and use any hit.
    With the fp32 prompt attention (no mask anywhere) the prompt fed alone uses the hit."""
    monkeypatch.setattr(fp32_chain_attention, "usable", lambda head_dim: False)
    assert not worth_reusing(16, 400, budget=512) and worth_reusing(16, 100, budget=512)
    assert worth_reusing(int(MIN_HIT_SHARE * 400), 400, budget=512) and not worth_reusing(0, 100, budget=512)
    template = repetitive_prompt(11, 16)  # one block
    long_prompt = template + repetitive_prompt(12, 200)
    expected = hf_greedy(llama, long_prompt, NEW)
    plain = []
    unmasked = type(llama)._plain_prefill
    monkeypatch.setattr(type(llama), "_plain_prefill", lambda self, *args: plain.append(unmasked(self, *args))
                        or plain[-1])
    for budget, hit, unmasked_forwards in ((256, 0, 1), (1024, 16, 0)):  # fed alone / could share its forward
        store = PrefixCache()
        decode(llama, [template + [5, 6, 7]], prefix_cache=store)
        plain.clear()
        results, decoder = decode(llama, [long_prompt], prefill_tokens=budget, prefix_cache=store)
        assert decoder.stats.prefix_hit_tokens == hit and results[0].token_ids == expected
        assert sum(plain) == unmasked_forwards  # the prompt's one forward ran without a mask only without the hit
    monkeypatch.undo()
    if fp32_chain_attention.usable(llama.fast.head_dim):
        store = PrefixCache()
        decode(llama, [template + [5, 6, 7]], prefix_cache=store)
        results, decoder = decode(llama, [long_prompt], prefill_tokens=256, prefix_cache=store)
        assert decoder.stats.prefix_hit_tokens == 16 and results[0].token_ids == expected


def test_a_small_hit_pays_where_no_prefill_is_masked():
    assert not worth_reusing(16, 400, budget=512) and worth_reusing(16, 400, budget=512, masked=False)
    assert not worth_reusing(0, 400, budget=512, masked=False)


def test_where_rows_attend_apart_a_small_hit_masks_its_row_even_in_a_shared_forward():
    """SDPA prompt chains (an AMX CPU's plan) attend row by row: a 200-token prompt's 16-token hit would mask its own
    row however many rows share the forward, so it is skipped there as for a prompt fed alone; a large one is
    used."""
    assert worth_reusing(16, 200, budget=1024) and not worth_reusing(16, 200, budget=1024, rows_apart=True)
    assert worth_reusing(int(MIN_HIT_SHARE * 200), 200, budget=1024, rows_apart=True)
    assert worth_reusing(16, 200, budget=1024, masked=False, rows_apart=True)


def test_a_scope_reads_only_its_own_blocks_within_one_budget(llama, prompts):
    """Two scopes of one store (a job's methods): a prompt one scope prefilled is a miss for the other, a hit for
    itself; both scopes' blocks count against the one budget."""
    shared = repetitive_prompt(97, 40)
    store = PrefixCache()
    decode(llama, [shared + prompts[0]], prefix_cache=store.scope("ar"))  # 46 tokens: 2 whole blocks
    block_bytes = store.nbytes // 2
    _, other = decode(llama, [shared + prompts[1]], prefix_cache=store.scope("copyspec"))  # 81 tokens: 5 blocks
    assert other.stats.prefix_hit_tokens == 0 and store.nbytes == (2 + 5) * block_bytes
    _, same = decode(llama, [shared + prompts[1]], prefix_cache=store.scope("ar"))
    assert same.stats.prefix_hit_tokens == 32


def test_an_engines_methods_each_start_from_their_own_state(llama, prompts):
    """A method's decoder never sees another method's prefix blocks, step costs or acceptance, so its figures are
    those of it running alone; a later decoder of the same method keeps what the earlier one learned."""
    from specdec_core.engine import BatchItem, Engine

    engine = Engine.from_runners(llama)
    shared = repetitive_prompt(96, 40)
    items = [BatchItem(0, shared + prompts[0], DecodeParams(max_new_tokens=NEW))]
    ar = engine.decoder(2, method="ar")
    for item in items:
        ar.submit(engine.request(item, "ar", None, ar))
    list(ar.run())
    copyspec = engine.decoder(2, method="copyspec")
    again = engine.decoder(2, method="ar")
    assert copyspec.budget.cost is not ar.budget.cost and again.budget.cost is ar.budget.cost
    assert copyspec.budget.pooled is not ar.budget.pooled and again.budget.pooled is ar.budget.pooled
    assert copyspec.prefix_cache.lookup(items[0].prompt_ids) == []
    assert len(again.prefix_cache.lookup(items[0].prompt_ids)) == 2
    engine.forget()
    assert engine.decoder(2, method="ar").prefix_cache.lookup(items[0].prompt_ids) == []
