"""Lossless mechanics on a tiny random Llama (fp32): for every variant of method, options, batch size and speculation
budget, each row's greedy output equals HF greedy's for that prompt alone, token for token. One batch holds prompts of
very different lengths, rows that finish early, rows admitted late (more requests than slots), rows with and without
a context document; a row failing mid-batch errors alone; rows of one batch use different drafters. The draft model
is a seeded noisy copy of the target, so its drafts are rejected now and then. test_lossless.py checks every method
once on the real model."""

import pytest

from specdec_core.drafters.base import Drafter
from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.drafters.retrieval_index import write_index
from specdec_core.engine import BatchItem, Engine
from specdec_core.loop.requests import DecodeParams
from specdec_core.methods import MethodOptions
from specdec_core.prompts import tokenizer_fingerprint
from tests.tiny_models import DigitsTokenizer, hf_greedy, noisy_llama, repetitive_prompt, tiny_llama

LENGTHS = [6, 41, 13, 60, 24, 9, 33, 18]  # the longest is 10x the shortest
MAX_NEW = 32
EARLY = {2: 9, 5: 4}  # rows that finish while others still run

# (method, options, batch size, speculation budget on): the variants test_lossless.py ran on the real model.
VARIANTS = {
    "pld-b3": ("pld", MethodOptions(), 3, False),
    "copyspec-b1": ("copyspec", MethodOptions(), 1, False),
    "copyspec-b3": ("copyspec", MethodOptions(), 3, False),
    "copyspec-b8-budget": ("copyspec", MethodOptions(), 8, True),
    "copyspec-candidates3-b8": ("copyspec", MethodOptions(candidates=3), 8, False),
    "pld-candidates3-b8": ("pld", MethodOptions(candidates=3), 8, False),
    "copyspec+draft-b8": ("copyspec+draft", MethodOptions(), 8, False),
    "pld-adaptive-b8": ("pld", MethodOptions(adaptive=True), 8, False),
    "copyspec-adaptive-b3-budget": ("copyspec", MethodOptions(adaptive=True), 3, True),
    "copyspec-gamma5-m32-b8": ("copyspec", MethodOptions(gamma=5, copy_tokens=32), 8, False),
    "draft-adaptive-b3": ("draft", MethodOptions(adaptive=True), 3, False),
    "draft-b8-budget": ("draft", MethodOptions(), 8, True),
    "pld_plus_h-b1": ("pld_plus_h", MethodOptions(), 1, False),
    "pld_plus_h-b8-budget": ("pld_plus_h", MethodOptions(hidden_layer=1, adaptive=True), 8, True),
    "pld_plus_a-b3": ("pld_plus_a", MethodOptions(), 3, False),
    "casd_strict-b8-budget": ("casd_strict", MethodOptions(), 8, True),
    "spectra-b3": ("spectra", MethodOptions(spectra_pool=6), 3, False),
    "spectra-small-b8-budget": ("spectra", MethodOptions(spectra_n=4, spectra_pool=4, spectra_guesses=4), 8, True),
    "rest-b3": ("rest", MethodOptions(), 3, False),
    "spectra+retrieval-b8-budget": ("spectra+retrieval", MethodOptions(spectra_pool=4), 8, True),
}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_runners(tiny_llama(0), noisy_llama())  # the draft model: tiny_models.noisy_llama


@pytest.fixture(scope="module")
def prompts():
    return [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def reference(engine, prompts):
    return [hf_greedy(engine.target, prompt, EARLY.get(key, MAX_NEW)) for key, prompt in enumerate(prompts)]


@pytest.fixture(scope="module")
def index(engine, reference, tmp_path_factory):
    """A corpus holding the later halves of some answers, and unrelated tokens."""
    directory = tmp_path_factory.mktemp("index") / "index"
    texts = [answer[MAX_NEW // 2:] for answer in reference[::2]] + [[3, 4, 5, 6, 7] * 6]
    write_index(directory, texts, {"model": "tiny-llama", "tokenizer": tokenizer_fingerprint(DigitsTokenizer())})
    return str(directory)


@pytest.fixture(autouse=True)
def fixed_induction_heads(monkeypatch):
    """pld_plus_a ranks occurrences by chosen heads; a random model has no induction heads worth discovering (and
    discovery reads the real corpora), so every head of the tiny model is chosen."""
    from specdec_core.drafters import pld_plus

    ranking = {"heads": [[layer, head, 1] for layer in range(2) for head in range(4)]}
    monkeypatch.setattr(pld_plus, "head_ranking", lambda runner: ranking)


def items(prompts, reference=None):
    """With the reference, odd rows get a `context` holding the later half of their own answer (the copy drafters'
    second source; casd_strict drafts from it alone)."""
    out = [BatchItem(key, prompt, DecodeParams(max_new_tokens=EARLY.get(key, MAX_NEW)))
           for key, prompt in enumerate(prompts)]
    for item in out[1::2] if reference else []:
        answer = reference[item.key]
        item.context_ids = [11, 12] + answer[len(answer) // 2:] + [13]
    return out


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_ar_equals_hf_greedy(engine, prompts, reference, batch_size):
    got = dict(engine.decode_batch(items(prompts), "ar", batch_size=batch_size))
    assert [got[key]["output_token_ids"] for key in range(len(prompts))] == reference


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_output_equals_ar(engine, prompts, reference, index, variant):
    method, options, batch_size, budget = VARIANTS[variant]
    if "retrieval" in method or method == "rest":
        options = options.model_copy(update={"retrieval_index": index})
    got = dict(engine.decode_batch(items(prompts, reference), method, options, batch_size=batch_size,
                                   speculation_budget=budget))
    drafted, rejected_rows = 0, 0
    for key, answer in enumerate(reference):
        row = got[key]
        assert row["error"] is None, row["error"]
        assert row["output_token_ids"] == answer, f"{variant} differs from greedy on prompt {key}"
        assert row["target_forwards"] <= len(answer)
        drafted += row["drafted_tokens"]
        rejected_rows += row["accepted_tokens"] < row["drafted_tokens"]
    assert drafted > 0, "the method never drafted, so the test proved nothing"
    if "draft" in method:  # the noisy draft model must be wrong now and then, or rollback went untested
        assert rejected_rows >= 2, rejected_rows


class FailsOnThirdStep(Drafter):
    def __init__(self):
        self.calls = 0
        self.fallback = CopySpecDrafter()

    def propose(self, tokens, max_tokens):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("drafter broke")
        return self.fallback.propose(tokens, max_tokens)


def test_a_row_failing_mid_batch_errors_alone(engine, prompts, reference):
    """One row's drafter raises on its third step: that row is an error, every other row is still exact."""
    decoder = engine.decoder(batch_size=3, speculation_budget=False)
    broken = 3
    for item in items(prompts):
        request = engine.request(item, "copyspec", MethodOptions(), decoder)
        if item.key == broken:
            request.drafter = FailsOnThirdStep()
        decoder.submit(request)
    results = dict(engine.results(decoder, "copyspec"))
    assert results[broken]["error"] == "RuntimeError: drafter broke"
    for key, answer in enumerate(reference):
        if key != broken:
            assert results[key]["output_token_ids"] == answer, key
    assert decoder.cache.lengths == []


def test_context_drafts_and_mixed_drafters_in_one_batch(engine, prompts, reference):
    """Each row's `context` holds the last two thirds of its own answer, and the rows of one batch use different
    drafters: every row still equals greedy, and context copies are counted as their own source."""
    decoder = engine.decoder(batch_size=4, speculation_budget=False)
    plans = [("pld", MethodOptions()), ("copyspec", MethodOptions()), ("casd_strict", MethodOptions()),
             ("copyspec", MethodOptions(candidates=3)), ("ar", MethodOptions()), ("draft", MethodOptions()),
             ("pld_plus_h", MethodOptions()), ("spectra", MethodOptions(spectra_pool=4))]
    methods = {}
    for item in items(prompts):
        method, options = plans[item.key % len(plans)]
        answer = reference[item.key]
        item.context_ids = [11, 12] + answer[len(answer) // 3:] + [13]
        decoder.submit(engine.request(item, method, options, decoder))
        methods[item.key] = method
    results = {request.key: engine.result_dict(methods[request.key], request.params, result)
               for request, result in decoder.run()}
    from_context = 0
    for key, answer in enumerate(reference):
        assert results[key]["error"] is None, results[key]["error"]
        assert results[key]["output_token_ids"] == answer, (methods[key], key)
        if methods[key] in ("pld", "copyspec", "casd_strict"):
            from_context += results[key]["accepted_by_source"].get("context", 0)
    assert from_context > 10, from_context
