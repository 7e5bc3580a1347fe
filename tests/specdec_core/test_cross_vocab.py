"""Different-vocabulary drafting (issue 11, first part): the vocabulary map, and TLI / union distributions that keep
the unchanged speculative-sampling verifier exact (χ² on synthetic vocabularies), with Theorem 4.1."""

from types import SimpleNamespace

import pytest
import torch

from specdec_core.drafters.base import Draft, RequestContext
from specdec_core.drafters.cross_vocab import (
    acceptance_rate,
    outside_id,
    tli_distribution,
    union_distribution,
    union_token,
)
from specdec_core.drafters.slrs import SlrsDrafter
from specdec_core.drafters.tli import TliDrafter, UnionDrafter
from specdec_core.drafters.vocab_mapping import VocabMapping, build_mapping, load_or_build_mapping, token_bytes
from specdec_core.loop.sampling import SamplingParams, make_generator
from specdec_core.loop.verification import verify_speculative_sampling
from tests.specdec_core.test_verification import chi2_p_value

# Target T = 6 tokens; draft D = 7 tokens. D's 0..3 are T's 2, 0, 5, 1; D's 4..6 are not in T; T's 3, 4 not in D.
MAPPING = VocabMapping(draft_to_target=torch.tensor([2, 0, 5, 1, -1, -1, -1]).numpy(),
                       target_to_draft=torch.tensor([1, 3, 0, -1, -1, 2]).numpy())
P = torch.tensor([0.30, 0.05, 0.20, 0.15, 0.10, 0.20])  # the target's next-token distribution
Q = torch.tensor([0.25, 0.10, 0.05, 0.10, 0.30, 0.15, 0.05])  # the drafter's
# SLRS: the first target token of each draft token's text. D's 4 starts with T's 3 (which D lacks), D's 5 is a longer
# token starting with T's 2, D's 6 is no text on its own (a partial UTF-8 byte).
FIRST = torch.tensor([2, 0, 5, 1, 3, 2, -1])


def first_tokens(method: str, trials: int = 20000, seed: int = 0) -> tuple[torch.Tensor, float]:
    """One-token drafts verified by the standard verifier; -> (counts of the emitted token, acceptance rate)."""
    generator = make_generator(seed)
    counts = torch.zeros(len(P))
    accepted = 0
    target_rows = torch.stack([P, P])  # [2, |T|]: after the pending token, after the draft token
    # The drafts are independent draws: drawn up front, one call.
    if method == "tli":
        q = tli_distribution(Q, MAPPING)  # [|T|]
        tokens = torch.multinomial(q, trials, replacement=True, generator=generator).tolist()
    else:
        q = union_distribution(Q, MAPPING)  # [|T| + 1]
        tokens = [union_token(int(d), MAPPING) for d in torch.multinomial(Q, trials, replacement=True,
                                                                          generator=generator)]
    for token in tokens:
        result = verify_speculative_sampling([token], target_rows, generator, q[None])
        emitted = token if result.num_accepted == 1 else result.next_token
        accepted += result.num_accepted
        counts[emitted] += 1
    return counts, accepted / trials


@pytest.mark.parametrize("method", ["tli", "union"])
def test_tli_and_union_drafts_leave_the_target_distribution_exact(method):
    counts, rate = first_tokens(method)
    assert counts[3] > 0 and counts[4] > 0  # target tokens the drafter does not have still come out
    assert chi2_p_value(counts, P) > 1e-3, counts
    expected = acceptance_rate(P, tli_distribution(Q, MAPPING) if method == "tli" else union_distribution(Q, MAPPING))
    assert rate == pytest.approx(expected, abs=0.015)


def drafted_chains(method: str, trials: int = 12000, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafters of the batched loop (drafters/tli.py), with a stub pool: two-token drafts chosen from the
    drafter's logits log Q at each position, translated to target ids, verified against P at each position.
    -> counts of the first emitted token, counts of the second (when the first was accepted)."""
    generator = make_generator(seed)
    drafter = {"tli": TliDrafter, "union": UnionDrafter, "slrs": SlrsDrafter}[method](
        SimpleNamespace(mapping=MAPPING, first_tokens=FIRST))
    drafter.request = RequestContext(prompt_len=0, sampling=SamplingParams(temperature=1.0), generator=generator)
    drafter._step = None
    first, second = torch.zeros(len(P)), torch.zeros(len(P))
    target_rows = torch.stack([P, P, P])  # [3, |T|]
    for _ in range(trials):
        drafter._targets = []  # what propose() starts SLRS's step with
        tokens, probs = [], []
        while len(tokens) < 2:
            token, more = drafter.choose(Q.log(), probs)
            if token is None:
                break
            tokens.append(token)
            if not more:
                break
        draft = Draft(tokens=tokens, source="draft_model", probs=torch.stack(probs) if probs else None)
        drafter.translate(draft)
        result = verify_speculative_sampling(draft.tokens, target_rows[: len(draft) + 1], generator, draft.probs)
        emitted = draft.tokens[: result.num_accepted] + [result.next_token]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    return first, second


@pytest.mark.parametrize("method", ["tli", "union", "slrs"])
def test_the_loop_drafters_chains_leave_the_target_distribution_exact(method):
    first, second = drafted_chains(method)
    assert second.sum() > 1000  # chains of two were drafted and their first token accepted
    assert chi2_p_value(first, P) > 1e-3, first
    assert chi2_p_value(second, P) > 1e-3, second


def test_greedy_tli_drafts_the_best_shared_token_and_union_stops_at_one_the_target_lacks():
    logits = Q.log()  # argmax: draft token 4, which the target lacks; the best shared one is 0 (target id 2)
    context = RequestContext(prompt_len=0, sampling=SamplingParams(temperature=0.0))
    tli, union = TliDrafter(SimpleNamespace(mapping=MAPPING)), UnionDrafter(SimpleNamespace(mapping=MAPPING))
    tli.request = union.request = context
    token, more = tli.choose(logits, [])
    assert (token, more) == (0, True) and MAPPING.draft_to_target[token] == 2
    assert union.choose(logits, []) == (None, False)


def test_drafting_stops_once_the_draft_model_is_unsure_of_the_whole_draft():
    context = RequestContext(prompt_len=0, sampling=SamplingParams(temperature=0.0))
    for confidence, goes_on in ((0.0, True), (0.2, True), (0.5, False)):  # the best shared token has q = 0.25
        drafter = TliDrafter(SimpleNamespace(mapping=MAPPING), confidence=confidence)
        drafter.request = context
        assert drafter.choose(Q.log(), []) == (0, goes_on), confidence
    # The draft's probability is the product over its tokens: 0.25, then 0.0625, below 0.1 at the second token
    # although each token alone is above it; a new step's draft starts again from 1.
    drafter = TliDrafter(SimpleNamespace(mapping=MAPPING), confidence=0.1)
    drafter.request = context
    assert drafter.choose(Q.log(), []) == (0, True)
    assert drafter.choose(Q.log(), []) == (0, False)
    drafter._draft_probability = 1.0  # what propose() does at each step
    assert drafter.choose(Q.log(), []) == (0, True)


def test_slrs_string_distribution_counts_every_draft_token_under_its_first_target_token():
    drafter = SlrsDrafter(SimpleNamespace(mapping=MAPPING, first_tokens=FIRST))
    psi = drafter.string_distribution(Q)  # [|T| + 1]
    assert psi.tolist() == pytest.approx([0.10, 0.10, 0.25 + 0.15, 0.30, 0.0, 0.05, 0.05])
    assert tli_distribution(Q, MAPPING)[3] == 0  # T's 3, which the drafter lacks: only SLRS can propose it
    drafter.request, drafter._targets = RequestContext(prompt_len=0, sampling=SamplingParams(temperature=0.0)), []
    assert drafter.choose(Q.log(), []) == (0, True) and drafter._targets == [2]  # greedy: argmax psi, fed as D's 0


def test_a_biased_emission_fails_the_same_check():
    counts, _ = first_tokens("tli")
    counts[0] += 600  # what a verifier that kept some rejected drafts would add
    assert chi2_p_value(counts, P) < 1e-3


def test_union_puts_the_mass_outside_the_target_in_its_own_column():
    q = union_distribution(Q, MAPPING)
    assert q.shape == (len(P) + 1,) and q[outside_id(MAPPING)] == pytest.approx(0.5)
    assert q[2] == pytest.approx(0.25) and q[3] == 0 and q.sum() == pytest.approx(1.0)
    assert union_token(5, MAPPING) == outside_id(MAPPING) and union_token(2, MAPPING) == 5


def test_tli_renormalises_over_the_shared_tokens_and_refuses_a_drafter_with_none():
    q = tli_distribution(Q, MAPPING)
    assert q.sum() == pytest.approx(1.0) and q[2] == pytest.approx(0.25 / 0.5) and q[3] == 0
    assert tli_distribution(torch.tensor([0, 0, 0, 0, 0.5, 0.5, 0.0]), MAPPING) is None


def test_theorem_4_1_tli_accepts_at_least_as_often_as_the_union_baseline():
    generator = torch.Generator().manual_seed(0)
    strictly = 0
    for trial in range(300):
        target_size, draft_size = 12, 15
        draft_to_target = torch.full((draft_size,), -1)
        shared = torch.randperm(draft_size, generator=generator)[: 1 + trial % 10]
        draft_to_target[shared] = torch.randperm(target_size, generator=generator)[: len(shared)]
        target_to_draft = torch.full((target_size,), -1)
        target_to_draft[draft_to_target[shared]] = shared
        mapping = VocabMapping(draft_to_target.numpy(), target_to_draft.numpy())
        sharpness = 0.2 + 5 * torch.rand(2, generator=generator)
        p = torch.softmax(torch.randn(target_size, generator=generator) * sharpness[0], dim=-1)
        q = torch.softmax(torch.randn(draft_size, generator=generator) * sharpness[1], dim=-1)
        tli, union = acceptance_rate(p, tli_distribution(q, mapping)), acceptance_rate(p, union_distribution(q, mapping))
        assert tli >= union - 1e-6
        strictly += tli > union + 1e-6
    assert strictly > 200  # equal only when q has no mass outside T


def test_byte_level_and_sentencepiece_tokens_match_by_the_bytes_they_stand_for(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from specdec_core.model.model_registry import resolve_model_path

    smol = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))  # byte-level BPE ('Ġ', 'Ċ')
    raw = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.train_from_iterator(["the cat sat on the mat\n", "def foo(x):\n    return x + 1\n"] * 20,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<bos>", "<eos>"]))
    raw.add_tokens([f"<0x{b:02X}>" for b in range(256)])  # byte fallback pieces, as SentencePiece models have
    piece = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")

    assert token_bytes(smol)[smol.convert_tokens_to_ids("Ċ")] == b"\n"
    mapping = build_mapping(piece, smol)
    pairs = {"▁the": "Ġthe", "▁cat": "Ġcat", "<0x41>": "A", "<eos>": smol.eos_token}
    for draft_token, target_token in pairs.items():
        target_id = mapping.draft_to_target[piece.convert_tokens_to_ids(draft_token)]
        assert target_id == smol.convert_tokens_to_ids(target_token), draft_token
    # "\n" is both a learned piece and the fallback <0x0A> here (as '.' and '<0x2E>' are in Gemma 3): both stand for
    # the target's 'Ċ', which maps back to the learned piece, the one the tokenizer emits.
    newline = smol.convert_tokens_to_ids("Ċ")
    learned = piece.convert_tokens_to_ids(piece.convert_ids_to_tokens(piece("\n", add_special_tokens=False)["input_ids"])[-1])
    assert token_bytes(piece)[learned] == b"\n" and learned != piece.convert_tokens_to_ids("<0x0A>")
    assert mapping.target_to_draft[newline] == learned
    assert mapping.draft_to_target[learned] == mapping.draft_to_target[piece.convert_tokens_to_ids("<0x0A>")] == newline
    assert mapping.draft_to_target[piece.convert_tokens_to_ids("<unk>")] == smol.unk_token_id
    shared = mapping.shared_draft_ids()
    # Every target token maps back to a draft token with its own bytes.
    back = mapping.target_to_draft[mapping.draft_to_target[shared]]
    draft_bytes = token_bytes(piece)
    assert all(draft_bytes[a] == draft_bytes[b] or draft_bytes[a] is None for a, b in zip(back, shared))
    assert mapping.shared == len(set(mapping.draft_to_target[shared].tolist()))  # |T ∩ D| counts target tokens
    # Cached per pair: the second load reads the file the first wrote.
    first = load_or_build_mapping(piece, smol, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    second = load_or_build_mapping(piece, smol, cache_dir=tmp_path)
    assert (first.draft_to_target == second.draft_to_target).all() and first.shared == mapping.shared


def test_draft_tokens_with_the_same_bytes_add_their_mass_on_the_target_token():
    import numpy as np

    # Draft tokens 0 and 1 both stand for target token 0 (a piece and its byte fallback); 3 has no target token.
    mapping = VocabMapping(draft_to_target=np.array([0, 0, 1, -1]), target_to_draft=np.array([0, 2, -1]))
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    torch.testing.assert_close(tli_distribution(q, mapping), torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(union_distribution(q, mapping), torch.tensor([0.3, 0.3, 0.0, 0.4]))
    assert mapping.shared == 2
