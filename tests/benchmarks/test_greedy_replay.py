"""The greedy replay reproduces the batched decoder's steps exactly (budget off) for token-only drafters, chains and
trees, and refuses drafters that read the target."""

import pytest

from benchmarks.greedy_replay import replay_greedy
from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.drafters.prompt_lookup import PromptLookupDrafter
from specdec_core.drafters.retrieval import RetrievalTreeDrafter
from specdec_core.drafters.retrieval_index import load_index, write_index
from specdec_core.drafters.spectra import SpectraDrafter
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.speculation_budget import SpeculationBudget
from specdec_core.prompts import tokenizer_fingerprint
from tests.tiny_models import DigitsTokenizer, hf_greedy, repetitive_prompt, tiny_llama

NEW_TOKENS = 30


def test_replay_gives_the_decoders_forwards_and_acceptances_for_chains_and_trees(tmp_path):
    runner = tiny_llama()
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate([12, 30, 21, 17])]
    answers = [hf_greedy(runner, prompt, NEW_TOKENS) for prompt in prompts]
    write_index(tmp_path / "index", [a[12:] for a in answers] + [[3, 4, 5, 6, 7] * 5],
                {"model": "tiny-llama", "tokenizer": tokenizer_fingerprint(DigitsTokenizer())})
    index = load_index(str(tmp_path / "index"))
    drafters = {"rest": lambda: RetrievalTreeDrafter(index), "rest-4": lambda: RetrievalTreeDrafter(index, 4),
                "pld": lambda: PromptLookupDrafter(4), "copyspec": lambda: CopySpecDrafter(gamma=2, copy_tokens=6)}
    for name, make in drafters.items():
        decoder = BatchDecoder(runner, max_batch=4, budget=SpeculationBudget(enabled=False))
        for key, prompt in enumerate(prompts):
            decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=NEW_TOKENS), make()))
        decoded = {request.key: result for request, result in decoder.run()}
        accepted = 0
        for key, (prompt, answer) in enumerate(zip(prompts, answers)):
            assert decoded[key].token_ids == answer, (name, key)
            replayed = replay_greedy(make(), prompt, answer, NEW_TOKENS, max_draft=decoder.max_draft)
            metrics = decoded[key].metrics
            assert (replayed.target_forwards, replayed.accepted, replayed.drafted) == \
                   (metrics.target_forwards, metrics.accepted_tokens, metrics.drafted_tokens), (name, key)
            accepted += replayed.accepted
        assert accepted > 0, name  # the check above compared real drafting, not empty drafts


def test_a_drafter_that_reads_the_target_is_refused():
    with pytest.raises(ValueError, match="draft logits"):
        replay_greedy(SpectraDrafter(n=4, pool_rows=3, max_guesses=4), [1, 2, 3], [4, 5, 6], 8)
