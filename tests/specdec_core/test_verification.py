"""Verifiers: greedy exactness (chains, trees, batches), and χ² tests that the sampling verifiers reproduce the
target distribution (Leviathan, one-hot, trees, per row of a batch)."""

import pytest
import torch

from specdec_core.drafters.base import Draft
from specdec_core.loop.sampling import SamplingParams, logits_to_probs, make_generator
from specdec_core.loop.verification import (
    verify, verify_greedy, verify_rows, verify_speculative_sampling, verify_tree_greedy, verify_tree_sampling,
)


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


def simulate(target_rows, draft_rows, num_draft, generator, trials=12000, length=3):
    """Decode `length` tokens from a synthetic target whose position-j distribution is target_rows[j].

    draft_rows None = one-hot drafter that always proposes token 0 then 1, 2, ...; else sample drafts from them.
    Returns per-position token counts.
    """
    vocab = target_rows.shape[-1]
    counts = torch.zeros(length, vocab)
    if draft_rows is not None:  # independent draws from each position's q, drawn up front (one call per row)
        pools = [iter(torch.multinomial(draft_rows[j], trials * length, replacement=True, generator=generator).tolist())
                 for j in range(length)]
    for _ in range(trials):
        out: list[int] = []
        while len(out) < length:
            pos = len(out)
            k = min(num_draft, length - pos)
            if draft_rows is None:
                draft, q = [(pos + i) % vocab for i in range(k)], None
            else:
                q = draft_rows[pos : pos + k]  # [k, vocab]
                draft = [next(pools[pos + i]) for i in range(k)]
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


def test_out_of_vocabulary_probability_draft_is_replaced_from_the_residual():
    """A draft token the target cannot emit is rejected; the replacement follows max(p - q, 0), not p."""
    p = TARGET[0]  # target vocab 6
    q = torch.tensor([0.4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.6])  # the drafter's vocab is wider; x = 7 is outside
    residual = torch.clamp(p - q[:6], min=0.0)
    residual = residual / residual.sum()
    generator = make_generator(11)
    counts = torch.zeros(6)
    for _ in range(20000):
        result = verify_speculative_sampling([7], torch.stack([p, p]), generator, q[None])
        assert result.num_accepted == 0
        counts[result.next_token] += 1
    assert chi2_p_value(counts, residual) > 1e-3, counts
    assert counts[0] < 0.2 * 20000  # p - q is 0.1 at token 0: drawing from p would give ~0.5


def test_tree_greedy_walks_the_matching_branch():
    # Draft tree of draft_tree.py's docstring: [5, 6, 7] and [5, 8] share 5.
    tokens, parents = [5, 6, 7, 8], [-1, 0, 1, 0]
    # Node argmax: root -> 5, after 5 -> 8 (second branch), after 5 6 -> 7, after 5 6 7 -> 1, after 5 8 -> 2.
    result = verify_tree_greedy(parents, tokens, [5, 8, 7, 1, 2])
    assert (result.num_accepted, result.next_token, result.path) == (2, 2, (0, 3))
    result = verify_tree_greedy(parents, tokens, [5, 6, 7, 1, 2])
    assert (result.num_accepted, result.next_token, result.path) == (3, 1, (0, 1, 2))
    result = verify_tree_greedy(parents, tokens, [9, 6, 7, 1, 2])
    assert (result.num_accepted, result.next_token, result.path) == (0, 9, ())


def test_tree_sampling_reproduces_target_distribution():
    """Multi-candidate one-hot branches: the first token follows p(root), the second p(after it)."""
    # Root candidates 0, 2, 4; below candidate 0 one more candidate, 3. Node probs: root, after 0, after 0 3,
    # after 2, after 4.
    tokens, parents = [0, 2, 4, 3], [-1, -1, -1, 0]
    node_probs = torch.stack([TARGET[0], TARGET[1], TARGET[3], TARGET[2], TARGET[2]])
    generator = make_generator(21)
    first = torch.zeros(6)
    second_after_0 = torch.zeros(6)
    for _ in range(20000):
        result = verify_tree_sampling(parents, tokens, node_probs, generator)
        out = [tokens[i] for i in result.path] + [result.next_token]
        first[out[0]] += 1
        if out[0] == 0:
            second_after_0[out[1]] += 1
    assert chi2_p_value(first, TARGET[0]) > 1e-3, first
    assert chi2_p_value(second_after_0, TARGET[1]) > 1e-3, second_after_0


def test_batched_verifier_is_exact_per_row_and_seeded_rows_ignore_their_neighbours():
    """verify_rows over a batch: each row's emitted tokens follow its own target rows, and a seeded row draws
    the same tokens alone as beside other rows."""
    params = SamplingParams(temperature=1.0)
    logits = torch.log(torch.cat([TARGET[0:2], TARGET[2:3], TARGET[1:4]]).clamp_min(1e-30))  # rows of 2, 1, 3
    drafts = [Draft([0], "copy"), Draft([], "none"), Draft([2, 4], "copy")]
    generators = [make_generator(s) for s in (1, 2, 3)]
    first = torch.zeros(3, 6)
    for _ in range(20000):
        for row, result in enumerate(verify_rows(drafts, logits, [params] * 3, generators)):
            token = drafts[row].tokens[0] if result.num_accepted else result.next_token
            first[row, token] += 1
    assert chi2_p_value(first[0], TARGET[0]) > 1e-3, first[0]
    assert chi2_p_value(first[1], TARGET[2]) > 1e-3, first[1]
    assert chi2_p_value(first[2], TARGET[1]) > 1e-3, first[2]
    together = verify_rows(drafts, logits, [params] * 3, [make_generator(s) for s in (1, 2, 3)])
    alone = verify_rows(drafts[2:], logits[3:], [params], [make_generator(3)])
    assert together[2] == alone[0]


def test_batched_greedy_rows_share_one_argmax():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]])  # argmax 1 2 0 2
    drafts = [Draft([1, 0], "copy"), Draft([], "none")]
    results = verify_rows(drafts, logits, [SamplingParams()] * 2, [make_generator(0)] * 2)
    assert [(r.num_accepted, r.next_token) for r in results] == [(1, 2), (0, 2)]


def test_whole_batch_greedy_chains_equal_the_row_by_row_verifier():
    """Random steps: chain drafts that agree with the target's argmax for a random prefix (then a random token, an id
    past the vocabulary, or nothing), greedy trees and sampling rows among them. verify_rows with the step's ids
    (one tensor operation for the chains) returns what the row-by-row verifier returns."""
    vocab, generator = 50, torch.Generator().manual_seed(0)
    seen = set()  # accepted lengths of greedy chains: the trials must cover rejections and long accepts
    for trial in range(200):
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        drafts, sampling = [], []
        lengths = torch.randint(0, 7, (rows,), generator=generator).tolist()
        logits = torch.randn(sum(length + 1 for length in lengths), vocab, generator=generator)
        argmax, offset = logits.argmax(-1).tolist(), 0
        for length in lengths:
            agree = int(torch.randint(0, length + 1, (1,), generator=generator))
            tokens = argmax[offset: offset + agree] + torch.randint(0, vocab, (length - agree,),
                                                                  generator=generator).tolist()
            if length > agree and trial % 3 == 0:
                tokens[agree] = vocab + 7  # a token the target does not have: rejected
            kind = int(torch.randint(0, 6, (1,), generator=generator))
            if kind == 0 and length >= 2:
                drafts.append(Draft(tokens=tokens, source="copy", parents=[-1] + [0] * (length - 1)))
            else:
                drafts.append(Draft(tokens=tokens, source="copy"))
            sampling.append(SamplingParams(temperature=0.8, seed=trial) if kind == 1 else SamplingParams())
            offset += length + 1
        width = 1 + max(lengths)
        step_ids = torch.tensor([[5, *d.tokens] + [0] * (width - 1 - len(d.tokens)) for d in drafts])
        generators = lambda: [make_generator(trial) for _ in drafts]  # noqa: E731
        expected = verify_rows(drafts, logits, sampling, generators())
        assert verify_rows(drafts, logits, sampling, generators(), step_ids) == expected
        seen.update(r.num_accepted for r, d, s in zip(expected, drafts, sampling) if d.parents is None and s.greedy)
    assert {0, 1, 2, 3, 4, 5, 6} <= seen
