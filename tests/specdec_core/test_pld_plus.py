"""PLD+ (h): the ranking on hand-made hidden states, and the engine's hidden-state capture on a tiny model (the states a
drafter holds equal a fresh forward's over the accepted sequence, through accepted and rejected drafts and trees)."""

import numpy as np
import pytest
import torch

from specdec_core.drafters.base import ATTENTION, HIDDEN_STATES, Draft, Drafter
from specdec_core.drafters.pld_plus import HiddenStateLookupDrafter, default_hidden_layer, rank_by_hidden_state
from specdec_core.drafters.prompt_lookup import PromptLookupDrafter
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.prefix_cache import PrefixCache
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.speculation_budget import SpeculationBudget
from tests.tiny_models import repetitive_prompt, tiny_llama


def unit(*vectors):
    return torch.nn.functional.normalize(torch.tensor(vectors, dtype=torch.float32), dim=-1)


def test_ranking_picks_the_occurrence_whose_preceding_state_is_most_similar():
    # tokens: 0:5 1:7 2:9 3:8 4:7 5:3 6:2 7:7(pending)  -> candidates j = 1 and 4 (x_j = 7), compared via H[0], H[3].
    history = np.array([5, 7, 9, 8, 7, 3, 2, 7])
    # H[6] (t - 1) is closest to H[3] -> j = 4; PLD would take the first occurrence, j = 1.
    hidden = unit([1, 0], [0, 1], [0, 1], [0.6, 0.8], [1, 0], [1, 0], [0.5, 0.9])
    assert rank_by_hidden_state(history, hidden, threshold=None) == 4
    hidden_first = unit([0.5, 0.9], [0, 1], [0, 1], [1, 0], [1, 0], [1, 0], [0.5, 0.9])
    assert rank_by_hidden_state(history, hidden_first, threshold=None) == 1


def test_threshold_ties_and_missing_candidates():
    history = np.array([5, 7, 9, 8, 7, 3, 2, 7])
    opposite = unit([-1, 0], [0, 1], [0, 1], [-1, 0.01], [1, 0], [1, 0], [1, 0])  # both candidates' cos < 0
    assert rank_by_hidden_state(history, opposite, threshold=0.0) is None
    assert rank_by_hidden_state(history, opposite, threshold=None) == 4  # -0.99.. > -1
    same = unit([1, 0], [0, 1], [0, 1], [1, 0], [1, 0], [1, 0], [1, 0])
    assert rank_by_hidden_state(history, same, threshold=0.5) == 1  # a tie goes to the earliest occurrence
    assert rank_by_hidden_state(np.array([5, 6, 7, 8]), unit([1, 0], [1, 0], [1, 0]), None) is None
    assert rank_by_hidden_state(history, same[:5], None) is None  # states of positions < t are not all there


def test_drafter_accumulates_committed_states_and_drafts_after_the_best_occurrence():
    drafter = HiddenStateLookupDrafter(hidden_layer=1, num_tokens=3, threshold=None)
    tokens = [5, 7, 9, 8, 7, 3, 2, 7]
    drafter.observe_hidden(torch.tensor([[1.0, 0], [0, 1], [0, 1]]))  # positions 0..2 (a prefill)
    drafter.observe_hidden(torch.tensor([[0.6, 0.8], [1, 0], [1, 0], [0.5, 0.9]]))  # 3..6 (a step's accepted path)
    draft = drafter.propose(tokens, 10)
    assert draft.tokens == [3, 2, 7] and draft.source == "lookup" and draft.from_context
    assert drafter.propose(tokens, 2).tokens == [3, 2]
    assert default_hidden_layer(30) == 14 and default_hidden_layer(2) == 1


class Recording(Drafter):
    """Wraps a drafter and keeps the hidden states it was handed (finish() would free them)."""

    reads = frozenset({HIDDEN_STATES})

    def __init__(self, inner: HiddenStateLookupDrafter):
        self.inner, self.hidden_layer, self.seen = inner, inner.hidden_layer, []

    def start(self, tokens, request):
        self.inner.start(tokens, request)

    def observe_hidden(self, hidden):
        self.seen.append(hidden.clone())
        self.inner.observe_hidden(hidden)

    def propose(self, tokens, max_tokens):
        return self.inner.propose(tokens, max_tokens)

    def observe(self, tokens, draft, num_accepted):
        self.tokens = list(tokens)
        self.inner.observe(tokens, draft, num_accepted)


class TreeOfWrongAndRight(Drafter):
    """Drafts a tree whose first branch is wrong and second right (for the states of a moved tree path)."""

    reads = frozenset({HIDDEN_STATES})

    def __init__(self, layer, runner):
        self.hidden_layer, self.runner, self.seen, self.drafted = layer, runner, [], []

    def observe_hidden(self, hidden):
        self.seen.append(hidden.clone())

    def propose(self, tokens, max_tokens):
        with torch.inference_mode():
            right = int(self.runner.model(torch.tensor([tokens])).logits[0, -1].argmax())
        wrong = (right + 1) % 90 + 1
        self.drafted.append(min(4, max_tokens))
        return Draft(tokens=[wrong, 3, right, 4][:max_tokens], source="test", parents=[-1, 0, -1, 2][:max_tokens])

    def observe(self, tokens, draft, num_accepted):
        self.tokens = list(tokens)


@pytest.fixture(scope="module")
def runner():
    return tiny_llama()


def fresh_states(runner, tokens, layer):
    with torch.inference_mode():
        out = runner.model(torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states[layer][0]  # [T, H]


@pytest.mark.parametrize("layer", [0, 1])
def test_captured_states_equal_a_fresh_forward_over_the_accepted_sequence(runner, layer):
    """Rows of a batch with chains (PLD+ on repetitive prompts: accepts and rejects), a tree whose accepted path is
    moved, and a row that does not ask for states: each asking row holds exactly one state per committed token,
    equal to a forward over its final sequence."""
    decoder = BatchDecoder(runner, max_batch=4, max_draft=8, budget=SpeculationBudget(enabled=False))
    plus = [Recording(HiddenStateLookupDrafter(hidden_layer=layer, num_tokens=6, threshold=None)) for _ in range(2)]
    tree = TreeOfWrongAndRight(layer, runner)
    drafters = plus + [tree, PromptLookupDrafter()]
    for seed, drafter in enumerate(drafters):
        prompt = repetitive_prompt(seed, 20 + 9 * seed)
        decoder.submit(DecodeRequest(seed, prompt, DecodeParams(max_new_tokens=30), drafter))
    results = {request.key: result for request, result in decoder.run()}
    assert all(not isinstance(r, str) for r in results.values()), results
    assert sum(r.metrics.accepted_tokens for r in results.values()) > 0
    for drafter in plus + [tree]:
        held = torch.cat(drafter.seen)
        committed = drafter.tokens[:-1]  # the last emitted token is pending: the target never read it
        # The last step may commit draft tokens past max_new_tokens, which the output then drops (the row is done).
        assert len(committed) <= len(held) <= len(committed) + 8
        torch.testing.assert_close(held[: len(committed)], fresh_states(runner, committed, layer), atol=1e-4,
                                   rtol=1e-4)
    # A step whose tree holds the second branch accepts its first token (node 3, moved to offset 1): pending + at
    # least that one. (The last steps' trees are cut to the few tokens the row still needs.)
    with_branch = [states for drafted, states in zip(tree.drafted, tree.seen[1:]) if drafted >= 3]
    assert len(with_branch) > 4 and all(len(states) >= 2 for states in with_branch)


def test_a_layer_past_the_model_is_one_row_error(runner):
    decoder = BatchDecoder(runner, max_batch=2)
    decoder.submit(DecodeRequest("bad", [1, 2, 3], DecodeParams(max_new_tokens=4),
                                 HiddenStateLookupDrafter(hidden_layer=99)))
    decoder.submit(DecodeRequest("good", [1, 2, 3], DecodeParams(max_new_tokens=4), PromptLookupDrafter()))
    results = {request.key: result for request, result in decoder.run()}
    assert "hidden layer 99 is out of range" in results["bad"]
    assert len(results["good"].token_ids) == 4


# ----------------------------------------------------------------------------------------------------- PLD+ (a)
from specdec_core.drafters.induction_heads import copy_source, top_heads  # noqa: E402
from specdec_core.drafters.pld_plus import AttentionLookupDrafter, rank_by_attention  # noqa: E402


def test_attention_ranking_picks_the_most_attended_occurrence():
    history = np.array([7, 1, 7, 2, 7, 3, 7])  # candidates 0, 2, 4 for the pending 7
    assert rank_by_attention(history, torch.tensor([0.1, 0.0, 0.3, 0.0, 0.2, 0.4])) == 2  # 5 is no candidate
    assert rank_by_attention(history, torch.tensor([0.2, 0.0, 0.2, 0.0, 0.2, 0.4])) == 0  # ties: earliest
    assert rank_by_attention(history, torch.zeros(5)) is None  # weights must cover positions 0..t-1
    assert rank_by_attention(np.array([1, 2, 3]), torch.ones(2)) is None
    drafter = AttentionLookupDrafter(num_tokens=2)
    drafter.observe_attention(torch.tensor([0.1, 0.0, 0.3, 0.0, 0.2, 0.4]))
    assert drafter.propose(history.tolist(), 10).tokens == [2, 7]


def test_attention_is_asked_for_only_where_there_is_a_choice():
    """The loop computes the weights only when the pending token occurred twice or more; a lone occurrence is
    copied without them."""
    def drafter():  # one per sequence: a drafter's sequence only grows
        return AttentionLookupDrafter(num_tokens=2)

    assert drafter().wants_attention([7, 1, 7, 2, 7])
    assert not drafter().wants_attention([7, 1, 2, 7])  # one earlier 7
    assert not drafter().wants_attention([7, 1, 2, 3])  # none
    assert rank_by_attention(np.array([7, 1, 2, 7]), torch.zeros(0)) == 0
    assert drafter().propose([7, 1, 2, 7], 10).tokens == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_head_attention_equals_the_torch_reference(runner, dtype, monkeypatch):
    """rows_attention (one compiled pass over every row and layer) gives each row what head_attention gives it
    alone: rows of other lengths and cache rows, layers with other heads, a sliding window on one layer, fp32 and
    bf16 keys."""
    from specdec_core.kernels import head_attention as compiled
    from specdec_core.model import attention_probe
    from specdec_core.model.attention_probe import head_attention, rows_attention

    assert compiled.kernel() is not None
    from specdec_core.kernels.head_attention_kernel import as_f32  # its Python form, as the overload reads keys
    value = torch.tensor([1.5, -3.25], dtype=torch.bfloat16)
    assert [as_f32(b) for b in value.view(torch.int16).numpy().view(np.uint16)] == [1.5, -3.25]
    assert as_f32(np.float32(0.1)) == np.float32(0.1)
    monkeypatch.setattr(attention_probe, "attention_window", lambda runner, layer: 9 if layer == 1 else None)
    generator = torch.Generator().manual_seed(0)
    module = attention_probe.attention_module(runner, 0)
    kv_heads, d = runner.model.config.num_key_value_heads, module.head_dim
    cache = [torch.randn(5, kv_heads, 64, d, generator=generator).to(dtype) for _ in range(runner.num_layers)]
    rows, lengths = [3, 0, 4, 1], [40, 7, 64, 30]
    for heads in ({0: [3, 0], 1: [1]}, {0: [1], 1: [0, 1, 2, 3]}):
        queries = {layer: torch.randn(len(rows), len(h), d, generator=generator) for layer, h in heads.items()}
        got = rows_attention(runner, cache, rows, lengths, heads, queries)
        assert got.shape == (len(rows), max(lengths))
        for r, (row, length) in enumerate(zip(rows, lengths)):
            keys = {layer: cache[layer][row] for layer in heads}
            expected = head_attention(runner, keys, {layer: q[r] for layer, q in queries.items()}, heads, length,
                                      length - 1)
            torch.testing.assert_close(got[r, :length], expected, atol=1e-6, rtol=1e-5)
            assert (got[r, length:] == 0).all()
            assert (got[r, : max(0, length - 9)] > 0).all()  # layer 0 sees every key; layer 1 the last 9


def test_copy_source_prefers_the_longest_shared_suffix():
    # prompt: 5 8 9 | 6 8 9 ; output so far ... 6 8 then 9: both 9s match, the second shares "6 8".
    sequence = [5, 8, 9, 6, 8, 9, 1, 6, 8, 9]
    assert copy_source(sequence, prompt_len=6, position=9) == 5
    assert copy_source(sequence, prompt_len=6, position=6) is None  # 1 is not in the prompt
    ranking = {"heads": [[3, 1, 9], [0, 2, 4], [3, 0, 1], [1, 1, 0]]}
    assert top_heads(ranking, 2) == {3: [1], 0: [2]}
    assert top_heads(ranking, 10) == {3: [1, 0], 0: [2]}  # heads without a hit are never used


class RecordingAttention(AttentionLookupDrafter):
    """Keeps (tokens, weights handed over) after the prefill and after every step (observe_attention follows
    start() and observe())."""

    def __init__(self, heads, after_plan: bool = True):
        super().__init__(num_tokens=5)
        self.attention_heads, self.pairs, self.tokens = heads, [], None
        self.ranks_after_plan = after_plan

    def start(self, tokens, request):
        self.tokens = list(tokens)

    def wants_attention(self, tokens):
        assert list(tokens) == self.tokens
        return True  # every step's weights, to check them all

    def propose(self, tokens, max_tokens):
        draft = super().propose(tokens, max_tokens)
        # Never empty, so that a plan verifying every draft hands the weights over after the plan every step too.
        return draft if draft.tokens else Draft(tokens=[0], source="filler")

    def outline(self, tokens, max_tokens):
        draft = super().outline(tokens, max_tokens)
        return draft if draft.tokens else Draft(tokens=[0], source="filler")

    def observe_attention(self, weights):
        self.pairs.append((self.tokens, weights.clone()))
        super().observe_attention(weights)

    def observe(self, tokens, draft, num_accepted):
        self.tokens = list(tokens)
        super().observe(tokens, draft, num_accepted)


class TreeWithAttention(TreeOfWrongAndRight):
    reads = frozenset({HIDDEN_STATES, ATTENTION})

    def __init__(self, heads, runner):
        super().__init__(1, runner)
        self.attention_heads, self.tokens, self.pairs = heads, None, []

    def observe_attention(self, weights):
        if self.tokens is not None:  # after a step
            self.pairs.append((self.tokens, weights.clone()))

    def observe(self, tokens, draft, num_accepted):
        super().observe(tokens, draft, num_accepted)
        self.tokens = list(tokens)


def eager_attention(runner, tokens, heads):
    """Max over `heads` of the eager attention from the last position: the reference for the probe."""
    runner.model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            out = runner.model(torch.tensor([tokens]), output_attentions=True)
    finally:
        runner.model.config._attn_implementation = "sdpa"
    return torch.stack([out.attentions[layer][0, head, -1] for layer, hs in heads.items() for head in hs]).amax(0)


@pytest.mark.parametrize("after_plan", [True, False])
def test_attention_weights_equal_eager_attention_after_accepts_and_rejects(runner, after_plan):
    """After every step (chains with accepts and rejects, a tree whose second branch is accepted and moved, a row
    moved into a freed cache row), the weights handed to a row equal eager attention over its committed tokens, from
    the newest committed one: handed over before the proposal, or after the plan (Drafter.ranks_after_plan)."""
    heads = {0: [0, 3], 1: [1]}  # GQA: 4 query heads on 2 key/value heads
    # The budget is off: its measured payoff depends on wall time, and this test needs every draft verified.
    decoder = BatchDecoder(runner, max_batch=3, max_draft=8, budget=SpeculationBudget(enabled=False))
    drafters = [RecordingAttention(heads, after_plan) for _ in range(2)]
    tree = TreeWithAttention(heads, runner)
    for seed, drafter in enumerate(drafters):
        # the first row leaves early: the last moves into its cache row, and its weights must follow it; a waiting row
        decoder.submit(DecodeRequest(seed, repetitive_prompt(seed, 24 + 10 * seed),
                                     DecodeParams(max_new_tokens=6 if seed == 0 else 24), drafter))
    decoder.submit(DecodeRequest("tree", repetitive_prompt(5, 30), DecodeParams(max_new_tokens=24), tree))
    # then takes the freed cache row over: stale cache rows would read its keys
    decoder.submit(DecodeRequest("waiting", repetitive_prompt(7, 40), DecodeParams(max_new_tokens=4),
                                 PromptLookupDrafter()))
    results = {request.key: result for request, result in decoder.run()}
    assert all(not isinstance(r, str) for r in results.values()), results
    assert results["tree"].metrics.accepted_tokens > 0  # multi-node commits, through a moved tree path
    assert sum(results[k].metrics.drafted_tokens - results[k].metrics.accepted_tokens for k in (0, 1)) > 0
    for drafter in drafters:
        check_pairs(runner, drafter.pairs, heads)
    check_pairs(runner, tree.pairs, heads)


def check_pairs(runner, pairs, heads):
    assert len(pairs) > 2
    # The last step may commit draft tokens past max_new_tokens that the finished output drops: skip it if so.
    if len(pairs[-1][1]) != len(pairs[-1][0]) - 1:
        pairs = pairs[:-1]
    for tokens, weights in pairs:
        assert len(weights) == len(tokens) - 1  # every committed position; the pending token is not read yet
        torch.testing.assert_close(weights, eager_attention(runner, tokens[:-1], heads), atol=1e-5, rtol=1e-4)


def verified_drafts(kind):
    """PLD+ (a) on a tiny model's heads or PLD+ (h), keeping every draft the loop verified (observe's), how many
    times it ranked and the weights it was handed."""

    class VerifiedDrafts(kind):
        def __init__(self, **settings):
            super().__init__(num_tokens=5, **settings)
            self.verified, self.ranked, self.handed = [], 0, 0

        def observe_attention(self, weights):
            self.handed += 1
            super().observe_attention(weights)

        def _rank(self, history):
            self.ranked += 1
            return super()._rank(history)

        def observe(self, tokens, draft, num_accepted):
            if draft.tokens:
                self.verified.append(draft)
            super().observe(tokens, draft, num_accepted)

    return VerifiedDrafts


@pytest.mark.parametrize("kind", ["attention", "hidden"])
def test_pld_plus_ranks_only_the_drafts_the_plan_verifies(runner, monkeypatch, kind):
    """PLD+ ranks after the plan, for the rows it lets verify a draft (PLD+ (a): and computes their weights then):
    with every draft verified, no verified draft is the unranked outline the plan read; with a plan that verifies
    nothing, nothing is ranked and no weights are computed; the tokens are the same either way."""
    from specdec_core.drafters.pld_plus import UNRANKED_SOURCE
    from specdec_core.loop import batch_decode
    from specdec_core.loop.speculation_budget import StepCostModel

    heads = {0: [0, 3], 1: [1]}
    if kind == "attention":
        make = verified_drafts(AttentionLookupDrafter)
    else:
        make = lambda: verified_drafts(HiddenStateLookupDrafter)(hidden_layer=1, threshold=None)  # noqa: E731
    asked = []
    real = batch_decode.deliver_attention
    monkeypatch.setattr(batch_decode, "deliver_attention",
                        lambda target, cache, pending: asked.append(len(pending)) or real(target, cache, pending))
    prompts = [repetitive_prompt(seed, 36 + 6 * seed) for seed in range(3)]

    def run(budget):
        decoder = BatchDecoder(runner, max_batch=3, max_draft=8, budget=budget)
        drafters = [make() for _ in prompts]
        for drafter in drafters:
            if kind == "attention":
                drafter.attention_heads = heads
        for seed, (prompt, drafter) in enumerate(zip(prompts, drafters)):
            decoder.submit(DecodeRequest(seed, prompt, DecodeParams(max_new_tokens=20), drafter))
        results = {request.key: result.token_ids for request, result in decoder.run()}
        return results, drafters

    every, drafters = run(SpeculationBudget(enabled=False))
    verified = [draft for drafter in drafters for draft in drafter.verified]
    assert verified and sum(d.ranked for d in drafters) >= len(verified)
    assert (sum(asked) > 0) is (kind == "attention") and sum(d.handed for d in drafters) == sum(asked)
    assert all(draft.source != UNRANKED_SOURCE for draft in verified)
    asked.clear()
    # Width costs 100 plain steps: no plan ever drafts (no exploring steps either).
    never = SpeculationBudget(cost=StepCostModel(fixed=lambda rows, width: 1 + 100 * (width - 1)),
                              check_payoff=False, explore_every=0)
    plain, drafters = run(never)
    assert plain == every and asked == [] and all(not d.verified and not d.handed and not d.ranked for d in drafters)


def test_head_discovery_is_deterministic_and_saved_once(runner, tmp_path, monkeypatch):
    """Two discoveries rank the heads identically; the saved ranking is read back instead of discovered again."""
    from specdec_core.drafters import induction_heads

    prompts = [repetitive_prompt(seed, 30 + 7 * seed) for seed in range(2)]
    first = induction_heads.discover(runner, prompts, new_tokens=16)
    assert first["events"] > 0 and len(first["heads"]) == runner.num_layers * runner.model.config.num_attention_heads
    monkeypatch.setattr(induction_heads, "discovery_prompts", lambda tokenizer: prompts)
    path = tmp_path / "heads.json"
    calls = []
    real = induction_heads.discover
    monkeypatch.setattr(induction_heads, "discover",
                        lambda runner, found_prompts: calls.append(1) or real(runner, found_prompts, new_tokens=16))
    second = induction_heads.load_or_discover(runner, path)  # a second discovery, then saved
    assert second == first and calls == [1]
    assert induction_heads.load_or_discover(runner, path) == first and calls == [1]  # read back


@pytest.mark.slow
def test_head_discovery_finds_copying_heads_in_the_default_model(engine):
    """On the real model (one prompt), discovery sees copy events and its best heads attend to the copied
    token's source."""
    from specdec_core.drafters import induction_heads

    prompts = induction_heads.discovery_prompts(engine.tokenizer, count=1)  # one code edit
    found = induction_heads.discover(engine.target, prompts, new_tokens=16)
    assert found["events"] > 0 and found["heads"][0][2] > 0
    assert len(found["heads"]) == engine.target.num_layers * engine.target.model.config.num_attention_heads


def test_a_prefix_hit_hands_pld_plus_a_the_weights_of_a_miss(runner):
    """PLD+ (a) reads the cached keys and the newest committed query only, so its row copies a shared prompt prefix
    from the prefix cache instead of computing it; the weights it is handed (after the prefill and every step) still
    equal eager attention over every committed position, the copied ones included."""
    heads = {0: [0, 3], 1: [1]}
    store = PrefixCache(1 << 24)
    shared = repetitive_prompt(3, 40)  # two whole blocks and more
    # The first run stores the prefix; the second run's row starts with it.
    first = BatchDecoder(runner, max_batch=2, budget=SpeculationBudget(enabled=False), prefix_cache=store)
    first.submit(DecodeRequest("first", shared + [9, 4], DecodeParams(max_new_tokens=2), RecordingAttention(heads)))
    list(first.run())
    decoder = BatchDecoder(runner, max_batch=2, max_draft=8, budget=SpeculationBudget(enabled=False),
                           prefix_cache=store)
    drafter = RecordingAttention(heads)
    decoder.submit(DecodeRequest("hit", shared + repetitive_prompt(4, 12), DecodeParams(max_new_tokens=16), drafter))
    results = {request.key: result for request, result in decoder.run()}
    assert not isinstance(results["hit"], str), results
    assert decoder.stats.prefix_hit_tokens >= 32
    assert results["hit"].metrics.accepted_tokens > 0
    check_pairs(runner, drafter.pairs, heads)
