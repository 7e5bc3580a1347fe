"""SPECTRA-CORE: the dictionaries (sub-n-gram insertion, per-key cap, backward search), the τ rule, the pool logits
handed over from the verify forward (equal to separate forwards of each pool row), and exactness on a tiny model:
greedy equals HF's `generate` in a batch mixed with other drafters, seeded sampling draws what `ar` draws."""

import torch

from specdec_core.drafters.base import NoDrafter, RequestContext
from specdec_core.drafters.prompt_lookup import PromptLookupDrafter
from specdec_core.drafters.spectra import NgramDictionaries, SpectraDrafter
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.sampling import SamplingParams
from specdec_core.loop.speculation_budget import SpeculationBudget
from tests.tiny_models import hf_greedy, repetitive_prompt, tiny_llama


def test_a_completed_row_feeds_every_sub_ngram():
    d = NgramDictionaries(n=4, per_key=2)
    d.insert([1, 2, 3, 4])
    assert d.forward == {1: [(2, 3, 4)], 2: [(3, 4)], 3: [(4,)]}
    assert d.backward == {(1,): 2, (1, 2): 3, (1, 2, 3): 4}
    d.insert([1, 5, 6, 7])
    d.insert([1, 2, 3, 4])  # a repeat moves to the front
    assert d.forward[1] == [(2, 3, 4), (5, 6, 7)]
    d.insert([1, 8, 8, 8])  # a third continuation evicts the oldest
    assert d.forward[1] == [(8, 8, 8), (2, 3, 4)]
    assert d.backward[(1,)] == 8  # the latest write wins


def test_backward_search_tries_the_longest_context_first():
    d = NgramDictionaries(n=4, per_key=4)
    d.backward.update({(9,): 1, (7, 8, 9): 5, (8, 9, 5): 6, (5,): 2, (6,): 3})
    # after ...7 8 9: the 3-token key wins (5); then 8 9 5 -> 6; then "9 5 6" is unknown, "5 6" too, "6" -> 3.
    assert d.backward_guess([7, 8, 9], 3) == [5, 6, 3]
    assert d.backward_guess([4, 4], 3) == []  # nothing known: no guess


class Fixed(SpectraDrafter):
    def __init__(self, **kw):
        super().__init__(n=3, pool_rows=2, max_guesses=4, **kw)
        self.start([1, 2, 3], RequestContext(prompt_len=3))
        self.candidates = [[10, 11], [12, 13]]


def test_tau_rule_forces_a_token_not_yet_a_forward_key():
    logits = torch.zeros(2, 20)
    logits[:, 5], logits[:, 6] = 3.0, 2.0  # 5 is the argmax, 6 the runner-up
    forced = Fixed(force_unseen_probability=1.0)
    forced.dictionaries.forward[5] = [(1,)]  # 5 is already a key: the pool takes 6
    draft = forced.propose([1, 2, 3], 64)
    assert draft.probes == [1, 3] and draft.tokens == [10, 11, 12, 13]  # no guess for 3 yet: the two rows
    forced.observe_logits(draft.probes, logits)
    assert forced.candidates == [[11, 6], [13, 6]]
    plain = Fixed(force_unseen_probability=0.0)
    plain.dictionaries.forward[5] = [(1,)]
    draft = plain.propose([1, 2, 3], 64)
    plain.observe_logits(draft.probes, logits)
    assert plain.candidates == [[11, 5], [13, 5]]
    assert SpectraDrafter(tau=0.1).force_unseen == 0.9  # the literal reading of Algorithm 1 (r > tau forces)


def test_rows_feed_the_dictionaries_only_once_the_target_predicted_all_their_tokens():
    drafter = Fixed(force_unseen_probability=0.0)
    logits = torch.zeros(2, 20)
    for token in (7, 8, 9):
        logits[:, :] = 0.0
        logits[:, token] = 1.0
        drafter.observe_logits(drafter.propose([1, 2, 3], 64).probes, logits)
    assert drafter.candidates == [[8, 9], [8, 9]]
    assert drafter.dictionaries.forward == {7: [(8, 9)], 8: [(9,)]}  # only the gram 7 8 9: all predicted
    draft = drafter.propose([1, 2, 7], 64)
    assert draft.tokens[:2] == [8, 9] and draft.parents[:2] == [-1, 0]  # the guess first, then the pool rows


def test_rows_that_do_not_fit_are_not_probed():
    drafter = Fixed()
    draft = drafter.propose([1, 2, 3], 3)
    assert draft.tokens == [10, 11] and draft.probes == [1]


class RecordingSpectra(SpectraDrafter):
    """Keeps, per step, the tokens at propose time, the pool rows probed and the logits handed over."""

    def __init__(self):
        super().__init__(n=4, pool_rows=3, max_guesses=3)
        self.records = []

    def propose(self, tokens, max_tokens):
        draft = super().propose(tokens, max_tokens)
        self.pending = (list(tokens), {node: list(self.candidates[row]) for node, row in self.probe_row.items()})
        return draft

    def observe_logits(self, probes, logits):
        tokens, rows = self.pending
        self.records.extend((tokens, rows[node], logits[i].clone()) for i, node in enumerate(probes))
        super().observe_logits(probes, logits)


def test_pool_logits_from_the_verify_forward_equal_a_forward_of_each_pool_row():
    runner = tiny_llama()
    decoder = BatchDecoder(runner, max_batch=2, budget=SpeculationBudget(enabled=False))
    drafters = [RecordingSpectra(), RecordingSpectra()]
    for seed, drafter in enumerate(drafters):
        decoder.submit(DecodeRequest(seed, repetitive_prompt(seed, 20 + 7 * seed), DecodeParams(max_new_tokens=24),
                                     drafter))
    list(decoder.run())
    for drafter in drafters:
        assert len(drafter.records) >= 3 * 4  # 3 rows probed on most steps
        for tokens, row, logits in drafter.records[::4]:
            with torch.inference_mode():
                fresh = runner.model(torch.tensor([tokens + row])).logits[0, -1]
            torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=1e-4)


def test_greedy_equals_hf_in_a_batch_mixed_with_other_drafters():
    runner = tiny_llama()
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate([9, 31, 17, 44, 25])]
    decoder = BatchDecoder(runner, max_batch=3, budget=SpeculationBudget(enabled=False))
    make = [lambda: SpectraDrafter(n=4, pool_rows=5, max_guesses=5), PromptLookupDrafter, NoDrafter,
            lambda: SpectraDrafter(), lambda: SpectraDrafter(n=3, pool_rows=2, tau=1.0)]
    for key, (prompt, factory) in enumerate(zip(prompts, make)):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=40), factory()))
    results = {request.key: result for request, result in decoder.run()}
    accepted = 0
    for key, prompt in enumerate(prompts):
        assert results[key].token_ids == hf_greedy(runner, prompt, 40), key
        if key in (0, 3, 4):
            accepted += results[key].metrics.accepted_tokens
    assert accepted > 0, "no SPECTRA guess was ever accepted: the test proved nothing"


def test_seeded_sampling_draws_what_ar_draws():
    """Tree sampling verification (Algorithm 4 for one-hot guesses) makes one draw per emitted token: with the same
    seed a SPECTRA row samples ar's very tokens, although it verifies many guesses per step."""
    runner = tiny_llama()
    prompt = repetitive_prompt(3, 30)
    outputs = {}
    for name, drafter in (("ar", NoDrafter()), ("spectra", SpectraDrafter(n=3, pool_rows=4, max_guesses=4))):
        decoder = BatchDecoder(runner, max_batch=1, budget=SpeculationBudget(enabled=False))
        params = DecodeParams(max_new_tokens=48, sampling=SamplingParams(temperature=0.7, seed=5))
        decoder.submit(DecodeRequest(name, prompt, params, drafter))
        [(_, outputs[name])] = list(decoder.run())
    assert outputs["spectra"].token_ids == outputs["ar"].token_ids
    assert outputs["spectra"].metrics.accepted_tokens > 0
