"""Verifiers: greedy exactness, and χ² tests that the sampling verifiers reproduce the target distribution."""

import pytest
import torch

from specdec_core.sampling import SamplingParams, logits_to_probs, make_generator
from specdec_core.verification import verify, verify_greedy, verify_speculative_sampling


def test_greedy_accepts_argmax_prefix_then_recovers():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])  # argmax 1, 2, 0
    assert verify_greedy([1, 2], logits).num_accepted == 2
    assert verify_greedy([1, 2], logits).next_token == 0  # bonus
    result = verify_greedy([1, 0], logits)
    assert (result.num_accepted, result.next_token) == (1, 2)  # recovered
    assert verify_greedy([], logits[:1]).next_token == 1


def chi2_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson χ² goodness of fit; cells with expected count 0 must be empty."""
    n = counts.sum()
    expected = probs * n
    support = expected > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    stat = (((counts[support] - expected[support]) ** 2) / expected[support]).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def simulate(target_rows, draft_rows, num_draft, generator, trials=20000, length=3):
    """Decode `length` tokens from a synthetic target whose position-j distribution is target_rows[j].

    draft_rows None = one-hot drafter that always proposes token 0 then 1, 2, ...; else sample drafts from them.
    Returns per-position token counts.
    """
    vocab = target_rows.shape[-1]
    counts = torch.zeros(length, vocab)
    for _ in range(trials):
        out: list[int] = []
        while len(out) < length:
            pos = len(out)
            k = min(num_draft, length - pos)
            if draft_rows is None:
                draft, q = [(pos + i) % vocab for i in range(k)], None
            else:
                q = draft_rows[pos : pos + k]  # [k, vocab]
                draft = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(k)]
            result = verify_speculative_sampling(draft, target_rows[pos : pos + k + 1], generator, q)
            out.extend(draft[: result.num_accepted] + [result.next_token])
        for j in range(length):
            counts[j, out[j]] += 1
    return counts


TARGET = torch.tensor(
    [
        [0.5, 0.2, 0.15, 0.1, 0.05, 0.0],
        [0.05, 0.05, 0.3, 0.3, 0.3, 0.0],
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
        [0.3, 0.0, 0.3, 0.0, 0.4, 0.0],
    ]
)
DRAFT = torch.tensor(
    [
        [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
        [0.4, 0.2, 0.2, 0.1, 0.05, 0.05],
        [0.1, 0.1, 0.5, 0.1, 0.1, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
    ]
)


@pytest.mark.parametrize("num_draft", [1, 3])
@pytest.mark.parametrize("draft_rows, seed", [(DRAFT, 1234), (None, 99)], ids=["leviathan", "one_hot"])
def test_sampling_verifiers_reproduce_target_distribution(draft_rows, seed, num_draft):
    """Leviathan drafts sampled from q, and one-hot (copied) drafts: every position's tokens follow the target."""
    generator = make_generator(seed)
    counts = simulate(TARGET, draft_rows, num_draft, generator)
    for j in range(counts.shape[0]):
        assert chi2_p_value(counts[j], TARGET[j]) > 1e-3, (j, counts[j])


def test_chi2_check_can_fail():
    """The statistical check is not vacuous: sampling straight from the draft is rejected."""
    generator = make_generator(5)
    draws = torch.multinomial(DRAFT[0], 20000, replacement=True, generator=generator)
    counts = torch.bincount(draws, minlength=6).float()
    with pytest.raises(AssertionError):
        assert chi2_p_value(counts, TARGET[0]) > 1e-3


def test_verify_dispatches_on_temperature_and_applies_top_k():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 2)
    generator = make_generator(0)
    params = SamplingParams(temperature=1.0, top_k=1)
    # top-k=1 leaves only token 0, so a draft of 0 is always accepted and the bonus is 0.
    result = verify([0], logits, params, generator)
    assert (result.num_accepted, result.next_token) == (1, 0)
    result = verify([2], logits, params, generator)
    assert (result.num_accepted, result.next_token) == (0, 0)


def test_logits_to_probs_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(logits_to_probs(logits, SamplingParams(temperature=1.0)).sum(), torch.tensor(1.0))


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
