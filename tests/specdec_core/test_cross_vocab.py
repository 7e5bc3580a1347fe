"""Different-vocabulary drafting (issue 11, first part): the vocabulary map, and TLI / union distributions that keep
the unchanged speculative-sampling verifier exact (χ² on synthetic vocabularies), with Theorem 4.1."""

import pytest
import torch

from specdec_core.drafters.cross_vocab import (
    acceptance_rate, outside_id, tli_distribution, union_distribution, union_token,
)
from specdec_core.sampling import make_generator
from specdec_core.verification import verify_speculative_sampling
from specdec_core.vocab_mapping import VocabMapping, build_mapping, load_or_build_mapping, token_bytes
from tests.specdec_core.test_verification import chi2_p_value

# Target T = 6 tokens; draft D = 7 tokens. D's 0..3 are T's 2, 0, 5, 1; D's 4..6 are not in T; T's 3, 4 not in D.
MAPPING = VocabMapping(draft_to_target=torch.tensor([2, 0, 5, 1, -1, -1, -1]).numpy(),
                       target_to_draft=torch.tensor([1, 3, 0, -1, -1, 2]).numpy())
P = torch.tensor([0.30, 0.05, 0.20, 0.15, 0.10, 0.20])  # the target's next-token distribution
Q = torch.tensor([0.25, 0.10, 0.05, 0.10, 0.30, 0.15, 0.05])  # the drafter's


def first_tokens(method: str, trials: int = 20000, seed: int = 0) -> tuple[torch.Tensor, float]:
    """One-token drafts verified by the standard verifier; -> (counts of the emitted token, acceptance rate)."""
    generator = make_generator(seed)
    counts = torch.zeros(len(P))
    accepted = 0
    target_rows = torch.stack([P, P])  # [2, |T|]: after the pending token, after the draft token
    for _ in range(trials):
        if method == "tli":
            q = tli_distribution(Q, MAPPING)  # [|T|]
            token = int(torch.multinomial(q, 1, generator=generator))
        else:
            q = union_distribution(Q, MAPPING)  # [|T| + 1]
            token = union_token(int(torch.multinomial(Q, 1, generator=generator)), MAPPING)
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

    from specdec_core.model_registry import resolve_model_path

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
    # "\n" is both a learned piece and the fallback <0x0A> here: one of them (one to one) is the target's 'Ċ'.
    newline = mapping.target_to_draft[smol.convert_tokens_to_ids("Ċ")]
    assert newline >= 0 and token_bytes(piece)[newline] == b"\n"
    assert mapping.draft_to_target[piece.convert_tokens_to_ids("<unk>")] == smol.unk_token_id
    assert (mapping.target_to_draft[mapping.draft_to_target[mapping.shared_draft_ids()]]
            == mapping.shared_draft_ids()).all()  # one to one
    # Cached per pair: the second load reads the file the first wrote.
    first = load_or_build_mapping(piece, smol, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    second = load_or_build_mapping(piece, smol, cache_dir=tmp_path)
    assert (first.draft_to_target == second.draft_to_target).all() and first.shared == mapping.shared
