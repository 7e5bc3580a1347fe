"""The speculation budget picks the step width with the most expected tokens per unit of measured cost."""

import pytest

from specdec_core.loop.speculation_budget import (
    AcceptanceEstimate, DraftPricing, SpeculationBudget, StepCostModel, batch_bucket, context_bucket, critical_rows,
    expected_tokens, step_worth,
)


def chain(k):
    return list(range(1, k + 1))


def choose_width(budget, reaches, estimates, context=0) -> int:
    """The step's width T (1 = no drafts verified) under the budget's plan."""
    return 1 + max(budget.plan(reaches, estimates, context), default=0)


def budget(cost, **kwargs):
    """A budget with a known cost function; the tests of its arithmetic take any plan that beats a plain step."""
    return SpeculationBudget(cost=StepCostModel(fixed=cost), **{"min_advantage": 1.0, **kwargs})


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == 1 + 0.5 + 0.25 + 0.125
    assert batch_bucket(1) == 1 and batch_bucket(5) == 8 and batch_bucket(16) == 16


def test_cheap_wide_steps_and_good_acceptance_verify_whole_drafts():
    flat = budget(lambda rows, width: 1.0 + 0.01 * width)
    high = [AcceptanceEstimate(accepted=90, rejections=10)] * 4
    assert choose_width(flat, [chain(8)] * 4, high) == 9


def test_expensive_width_or_poor_acceptance_falls_back_to_plain_decoding():
    steep = budget(lambda rows, width: float(width))  # cost grows with every token: drafts never pay
    high = [AcceptanceEstimate(accepted=90, rejections=10)] * 4
    assert choose_width(steep, [chain(8)] * 4, high) == 1
    flat = budget(lambda rows, width: 1.0 + 0.1 * (width - 1))
    low = [AcceptanceEstimate(accepted=0, rejections=50)] * 4
    assert choose_width(flat, [chain(8)] * 4, low) == 1


def test_no_drafts_and_token_budget():
    flat = budget(lambda rows, width: 1.0)
    high = [AcceptanceEstimate(accepted=90, rejections=10)] * 4
    assert choose_width(flat, [[], [], [], []], high) == 1
    capped = budget(lambda rows, width: 1.0, token_budget=12)
    assert choose_width(capped, [chain(8)] * 4, high) == 3  # 4 rows x 3 tokens <= 12
    off = budget(lambda rows, width: float(width), enabled=False)
    assert choose_width(off, [chain(5), chain(2)], high) == 6


def test_a_new_row_starts_from_the_pooled_acceptance():
    b = budget(lambda rows, width: 1.0 + 0.2 * (width - 1))
    for _ in range(50):
        b.observe(AcceptanceEstimate(), drafted=4, accepted=0)  # the decoder's rows never accept
    assert choose_width(b, [chain(4)], [AcceptanceEstimate()]) == 1
    good = budget(lambda rows, width: 1.0 + 0.2 * (width - 1))
    for _ in range(50):
        good.observe(AcceptanceEstimate(), drafted=4, accepted=4)
    assert choose_width(good, [chain(4)], [AcceptanceEstimate()]) == 5


def test_long_drafts_with_modest_acceptance_are_cut_to_the_width_that_pays():
    # Every row proposes 10 tokens; a 2-wide step costs what a 1-wide one does, an 11-wide one 4x: T = 2 pays
    # (16 x 1.4 tokens for 1.0), although no row proposed exactly 1 token.
    cost = budget(lambda rows, width: 1.0 if width <= 2 else 1.0 + 0.3 * (width - 1))
    modest = [AcceptanceEstimate(accepted=40, rejections=60)] * 16
    assert choose_width(cost, [chain(10)] * 16, modest) == 2


def test_incremental_gain_equals_the_geometric_sums():
    """The plan builds E(T) width by width; a brute-force argmax over the closed form must agree (trees too)."""
    import random

    from specdec_core.loop.draft_tree import prefix_depths

    rng = random.Random(0)
    for _ in range(200):
        rows = rng.randint(1, 6)
        reaches = []
        for _ in range(rows):
            size = rng.randint(0, 9)
            parents = [rng.randint(-1, i - 1) for i in range(size)]
            reaches.append(prefix_depths(parents) if rng.random() < 0.5 else chain(size))
        estimates = [AcceptanceEstimate(accepted=rng.randint(0, 9), rejections=rng.randint(0, 9)) for _ in range(rows)]
        slope = rng.uniform(0.0, 0.5)
        cost = lambda rows, width: 1.0 + slope * (width - 1)  # noqa: E731
        chosen = choose_width(budget(cost), reaches, estimates)
        prior = AcceptanceEstimate().rate(prior=0.5)
        rates = [e.rate(prior) for e in estimates]
        longest = max(len(r) for r in reaches)
        values = {1: float(rows)}
        for width in range(2, longest + 2):
            gain = sum(expected_tokens(rate, reach[min(len(reach), width - 1) - 1]) if reach else 1.0
                       for rate, reach in zip(rates, reaches))
            values[width] = gain / cost(rows, width)
        best = max(values.values())
        assert abs(values[chosen] - best) < 1e-9, (reaches, chosen, values)


def test_a_plan_must_beat_a_plain_step_by_the_margin():
    """One row accepting 60 %: one draft token promises 1.6 tokens; at a cost of 1.5 plain steps that is 1.067x a
    plain step, over a 4 % margin; at 1.55 (1.032x) it is not, and the row decodes plainly."""
    estimate = [AcceptanceEstimate(accepted=600, rejections=400)]
    assert budget(lambda rows, width: 1.0 + 0.5 * (width - 1), min_advantage=1.04,
                  check_payoff=False).plan([chain(1)], estimate) == [1]
    assert budget(lambda rows, width: 1.0 + 0.55 * (width - 1), min_advantage=1.04,
                  check_payoff=False).plan([chain(1)], estimate) == [0]
    assert budget(lambda rows, width: 1.0 + 0.55 * (width - 1), min_advantage=1.0,
                  check_payoff=False).plan([chain(1)], estimate) == [1]


def test_step_costs_are_learned_from_the_steps_themselves():
    """No forward is spent on measuring: plain steps set the unit, wide steps the cost per computed token and per
    unit of width, told apart by steps where few rows draft (real tokens only) and steps where all do."""
    model = StepCostModel(prior_token=0.12, prior_width=0.03)
    assert not model.knows_plain(16, 100) and abs(model.ratio(16, 9, 100) - (1 + 0.12 * 8 + 0.03 * 8)) < 1e-9
    model.observe(16, 5, 0.30, context=100)  # a wide step before any plain one has no unit: ignored
    assert model.sums == {}
    model.observe(16, 1, 0.10, context=100)
    assert model.knows_plain(16, 100)
    true = lambda width, computed: 1 + 0.3 * (computed - 16) / 16 + 0.05 * (width - 1)  # noqa: E731
    for _ in range(40):
        for width, computed in ((9, 48), (5, 80), (3, 20), (9, 144)):
            model.observe(16, width, 0.10 * true(width, computed), context=100, computed=computed)
    token, per_width = model.slopes(16, 100)
    assert abs(token - 0.3) < 0.01 and abs(per_width - 0.05) < 0.01
    assert abs(model.ratio(16, 9, 100, computed=32) - true(9, 32)) < 0.02
    assert abs(model.ratio(16, 3, 100) - true(3, 48)) < 0.02  # padded: computed = rows x width


def test_the_unit_is_a_plain_step_at_the_same_row_count():
    """A bucket spans 9-16 rows: a wide 9-row step is measured against a plain 9-row step, not a 16-row one."""
    model = StepCostModel()
    model.observe(16, 1, 0.16, context=100)
    model.observe(9, 1, 0.09, context=100)
    for _ in range(60):
        model.observe(9, 5, 0.09 * (1 + 0.25 * 4), context=100)  # padded: x_token = 4, x_width = 4
    token, per_width = model.slopes(12, 100)
    assert abs(token * 4 + per_width * 4 - 1.0) < 0.02  # against the 16-row unit it would read 0.09 x 2 / 0.16 - 1
    assert model._plain(12, 100) == 0.09 and model._plain(15, 100) == 0.16  # the nearest row count timed


def test_a_new_bucket_borrows_a_conservative_fit_or_starts_from_the_priors():
    model = StepCostModel(prior_token=0.12, prior_width=0.03)
    model.observe(16, 1, 0.10, context=100)
    for _ in range(60):
        model.observe(16, 5, 0.10 * (1 + 0.3 * 4 + 0.1 * 4), context=100)
    here = model.slopes(16, 100)
    # Fewer rows (bucket 4) or a longer context: the 16-row, short-context fit is at least as steep.
    assert model.slopes(3, 100) == here and model.slopes(16, 2000) == here
    assert abs(model.ratio(3, 5, 100) - 2.6) < 0.02
    # More rows than ever seen, or a shorter context than any measured: nothing conservative, the priors.
    assert model.slopes(32, 100) == (0.12, 0.03)
    assert not model.knows_plain(3, 100)  # the unit is per bucket: a plain step comes first there


def test_when_padding_is_skipped_a_row_with_poor_acceptance_verifies_nothing_beside_rows_that_verify_long_drafts():
    """Real tokens only: a row's drafts cost what it verifies. Rows accepting 95 % draft their 8 tokens, rows
    accepting 10 % none; padded, the step would make every row pay for the width."""
    b = SpeculationBudget(cost=StepCostModel(prior_token=0.3, prior_width=0.03), check_payoff=False, ragged=True)
    b.record_step(16, 1, tokens=16, seconds=0.1, context=100)
    good, poor = AcceptanceEstimate(accepted=95, rejections=5), AcceptanceEstimate(accepted=1, rejections=9)
    plan = b.plan([chain(8)] * 16, [good] * 4 + [poor] * 12, context=100)
    assert plan == [8] * 4 + [0] * 12
    padded = SpeculationBudget(cost=StepCostModel(prior_token=0.3, prior_width=0.03), check_payoff=False)
    padded.record_step(16, 1, tokens=16, seconds=0.1, context=100)
    assert max(padded.plan([chain(8)] * 16, [good] * 4 + [poor] * 12, context=100)) <= 1  # 16 x 9 computed
    # A middling row drafts as deep as its next token is still worth its cost (a^d >= value x s_token / rows).
    middling = AcceptanceEstimate(accepted=6, rejections=4)
    plan = b.plan([chain(8)] * 16, [good] * 4 + [middling] + [poor] * 11, context=100)
    assert plan[:4] == [8] * 4 and 0 < plan[4] < 8 and plan[5:] == [0] * 11


def test_the_first_step_of_a_bucket_is_plain_and_sets_the_unit():
    b = SpeculationBudget()
    high = [AcceptanceEstimate(accepted=90, rejections=10)] * 4
    assert choose_width(b, [chain(8)] * 4, high, context=100) == 1
    b.record_step(4, 1, tokens=4, seconds=0.10, context=100)
    assert choose_width(b, [chain(8)] * 4, high, context=100) > 1  # prior slope 0.15, acceptance 0.9: drafts pay


def test_context_buckets_grow_by_four():
    assert [context_bucket(n) for n in (0, 256, 257, 1024, 1025, 5000)] == [256, 256, 1024, 1024, 4096, 16384]


def test_measured_payoff_shrinks_speculation_that_loses_to_plain_steps():
    """The model says width 5 pays (cheap widths, good acceptance), but the clock says speculative steps deliver
    fewer tokens per second than plain ones: the penalty grows until the budget picks plain steps."""
    b = budget(lambda rows, width: 1.0 + 0.02 * width)
    estimates = [AcceptanceEstimate(accepted=8, rejections=2)] * 4
    reaches = [chain(4)] * 4
    assert choose_width(b, reaches, estimates) == 5
    b.record_step(4, 1, tokens=4, seconds=0.10)  # plain: 40 tok/s
    for _ in range(30):
        b.record_step(4, 5, tokens=6, seconds=0.30)  # speculative: 20 tok/s
    assert b.payoff.penalty[4] == 16
    b.record_step(4, 1, tokens=4, seconds=0.10)  # a plain step: no probe is due now
    assert not b.payoff.probe_due(4) and choose_width(b, reaches, estimates) == 1
    # Only plain steps from here: the penalty decays slowly, so drafting is tried again later.
    for _ in range(200):
        b.record_step(4, 1, tokens=4, seconds=0.10)
    assert b.payoff.penalty[4] == 1.0 and choose_width(b, reaches, estimates) == 5


def test_measured_payoff_leaves_winning_speculation_alone_and_probes_plain_steps():
    b = budget(lambda rows, width: 1.0 + 0.02 * width)
    estimates = [AcceptanceEstimate(accepted=8, rejections=2)] * 4
    reaches = [chain(4)] * 4
    b.record_step(4, 1, tokens=4, seconds=0.10)  # 40 tok/s
    chosen = []
    for _ in range(40):
        width = choose_width(b, reaches, estimates)
        chosen.append(width)
        b.record_step(4, width, tokens=4 if width == 1 else 12, seconds=0.10 if width == 1 else 0.12)  # 100 tok/s
    assert b.payoff.penalty.get(4, 1.0) == 1.0
    assert chosen.count(1) == 1 and chosen.count(5) == 39  # one probe in 40 steps once drafting clearly pays
    assert choose_width(budget(lambda rows, width: 1.0, check_payoff=False), reaches, estimates) == 5


def test_rows_whose_drafts_were_refused_are_explored_now_and_then():
    b = budget(lambda rows, width: float(width))  # width costs in proportion: the model never drafts
    estimates = [AcceptanceEstimate(accepted=0, rejections=5)] * 4
    widths = [choose_width(b, [chain(4)] * 4, estimates) for _ in range(32)]
    assert widths.count(2) == 2 and widths[15] == 2 and widths[31] == 2 and set(widths) == {1, 2}
    assert choose_width(budget(lambda rows, width: float(width), explore_every=0), [chain(4)] * 4, estimates) == 1


def test_refused_drafting_rests_until_the_next_exploring_step():
    """After rest_after refused steps the rows stop proposing; the step before exploration proposes again (it needs
    drafts), and the exploring step keeps its cadence of one in explore_every."""
    b = budget(lambda rows, width: float(width))
    estimates = [AcceptanceEstimate(accepted=0, rejections=5)] * 4
    plan = []  # per step: (proposed?, width)
    for _ in range(32):
        foreseen = not b.rests_next()
        assert b.rests_next() == (not foreseen)  # asking changes nothing
        due = b.drafting_due()
        assert due == foreseen, len(plan)  # (the loop puts bookkeeping off on what rests_next foresees)
        if due:
            plan.append((True, choose_width(b, [chain(4)] * 4, estimates)))
        else:
            plan.append((False, choose_width(b, [[]] * 4, estimates)))  # no drafts: width 1
    proposed = [p for p, _ in plan]
    assert proposed[:4] == [True] * 4 and proposed[4:15] == [False] * 11 and proposed[15]
    assert [w for _, w in plan].count(2) == 2 and plan[15] == (True, 2) and plan[31] == (True, 2)
    assert sum(proposed) == 10  # 2 x (4 refused + 1 exploring) of 32 steps
    always = budget(lambda rows, width: float(width), rest_after=0)
    assert all(always.drafting_due() for _ in range(40))
    assert all(budget(lambda rows, width: float(width), enabled=False).drafting_due() for _ in range(40))


def test_a_row_cut_to_nothing_while_others_draft_is_explored_now_and_then():
    """Its estimate learns only from drafts it verifies: after explore_every steps cut to nothing, one node."""
    b = SpeculationBudget(cost=StepCostModel(prior_token=0.3, prior_width=0.03), check_payoff=False, ragged=True)
    b.record_step(16, 1, tokens=16, seconds=0.1, context=100)
    good = [AcceptanceEstimate(accepted=95, rejections=5) for _ in range(4)]
    poor = [AcceptanceEstimate(accepted=1, rejections=9) for _ in range(12)]
    plans = [b.plan([chain(8)] * 16, good + poor, context=100) for _ in range(32)]
    assert all(plan[:4] == [8] * 4 for plan in plans)
    explored = [plan[4] for plan in plans]
    assert explored.count(1) == 2 and explored[15] == 1 and explored[31] == 1 and set(explored) == {0, 1}


def test_the_price_of_a_drafted_token_is_its_measured_cost_over_a_tokens_measured_worth():
    pricing = DraftPricing(alpha=0.5)
    assert pricing.floor() is None  # nothing measured: the drafter keeps its fallback floor
    pricing.record_step(tokens=4, seconds=0.8)  # 0.2 s per token emitted
    assert pricing.floor() is None
    pricing.record_forward(seconds=0.1)
    pricing.verify_s = 0.02
    assert pricing.floor() == pytest.approx((0.1 + 0.02) / 0.2)  # one row drafting pays the whole forward
    pricing.drafting_rows = 4
    assert pricing.floor() == pytest.approx((0.025 + 0.02) / 0.2)  # four share it
    pricing.drafting_rows = 2
    pricing.record_step(tokens=10, seconds=0.6)  # a ratio of averages: (0.4 + 0.3) / (2 + 5), not (0.2 + 0.06) / 2
    assert pricing.token_s == pytest.approx(0.7 / 7)
    pricing.record_prefill(0.5)  # a draft-model prompt catch-up in the next step is prefill, not drafting
    pricing.record_step(tokens=7, seconds=1.2)
    assert pricing.token_s == pytest.approx((0.35 + 0.35) / (3.5 + 3.5))
    pricing.record_step(tokens=7, seconds=0.7)  # (counted once)
    assert pricing.token_s == pytest.approx(0.1)
    pricing.record_forward(seconds=20.0)  # a drafter dearer than a token: only a certain token pays
    assert pricing.floor() > 1.0
    cheap = DraftPricing(step_s=1.0, step_tokens=1.0, forward_s=0.0)
    assert cheap.floor() == pytest.approx(0.02)  # never 0 (that would mean: draft the full length)


def test_the_token_budget_caps_every_rows_nodes():
    assert SpeculationBudget(token_budget=32).most_nodes(8) == 3
    assert SpeculationBudget(token_budget=4).most_nodes(8) == 0
    assert SpeculationBudget().most_nodes(8) > 1000


def test_a_verified_token_costs_the_token_slope_of_a_plain_step_per_row():
    cost = StepCostModel(prior_token=0.2, prior_width=0.0)
    assert cost.token_seconds(4) == 0.0  # no plain step timed yet
    cost.observe(4, 1, 0.4)
    assert cost.token_seconds(4) == pytest.approx(0.2 * 0.4 / 4)


def test_the_clocks_check_counts_drafting_seconds_and_the_target_cost_model_does_not():
    """A wide step that paid 0.5 s of drafting for its 0.5 s forward delivered 8 tokens/s against a plain step's
    10: the clock's check calls it a loss (it would call it a win at 16 tokens/s, the forward alone); the target's
    cost model learns the forward alone (0.5 / 0.4 - 1 = 0.25 over a plain step)."""
    for drafting_s, losing in ((0.5, True), (0.0, False)):
        b = SpeculationBudget()
        b.record_step(4, 1, 4, 0.4)  # plain: 10 tokens/s
        b.record_step(4, 3, 8, 0.5, drafting_s=drafting_s)
        assert (b.payoff.penalty[4] > 1.0) is losing
        x_token, y = 2.0, 0.25  # (12 computed - 4 rows) / 4 rows; 0.5 / 0.4 - 1
        assert b.cost.sums[(4, 256)][3] == pytest.approx(x_token * y)


def test_with_nothing_waiting_only_the_rows_that_can_still_set_the_passs_length_draft():
    # margin = ceil(share x the most left): rows further ahead of the longest row than speculation saved so far
    assert critical_rows([100, 91, 89, 20], saved_share=0.1) == [True, True, False, False]
    assert critical_rows([5, 4, 1], saved_share=0.0) == [True, True, False]  # at least one token of margin
    assert critical_rows([], saved_share=0.5) == []
    b = budget(lambda rows, width: 1.0 + 0.01 * width)
    b.emitted(kept=92, accepted=0)
    b.emitted(kept=8, accepted=8)  # 8 of 100 tokens from drafts: share (8 + 1) / (100 + 2), a margin of 9 of 100
    high = [AcceptanceEstimate(accepted=90, rejections=10)] * 3
    assert b.plan([chain(4)] * 3, high, critical=b.critical([100, 95, 60])) == [4, 4, 0]
    assert b.plan([chain(4)] * 3, high) == [4, 4, 4]  # a queue waits: every accepted token is work done
    fresh = budget(lambda rows, width: 1.0 + 0.01 * width)  # no evidence yet: prior 0.5, everyone within the margin
    assert fresh.plan([chain(4)] * 3, high, critical=fresh.critical([100, 95, 60])) == [4, 4, 4]


def test_a_budget_for_a_target_prices_its_forwards_as_they_run():
    class Target:
        ragged, gather_share = object(), 0.4

    budget = SpeculationBudget.for_target(Target(), token_budget=32)
    assert budget.ragged and budget.gather_share == 0.4 and budget.token_budget == 32
    Target.ragged = None
    assert not SpeculationBudget.for_target(Target()).ragged


def test_a_drafts_own_confidence_prices_it_per_node():
    """The same proposals, priced by the drafter's confidence instead of the rows' geometric rate: a copy the
    drafter is sure of is verified whole where a modest rate would cut it, and nodes it doubts are cut where a high
    rate would verify them."""
    cost = lambda rows, width: 1.0 + 0.12 * (width - 1)  # noqa: E731
    modest = [AcceptanceEstimate(accepted=50, rejections=50)] * 2
    assert choose_width(budget(cost), [chain(8)] * 2, modest) < 9
    sure = [[1.0] * 8] * 2
    assert max(budget(cost).plan([chain(8)] * 2, modest, confidences=sure)) == 8
    high = [AcceptanceEstimate(accepted=95, rejections=5)] * 2
    assert choose_width(budget(cost), [chain(8)] * 2, high) == 9
    doubted = [[0.9, 0.8, 0.05, 0.04, 0.03, 0.02, 0.01, 0.01]] * 2
    assert budget(cost).plan([chain(8)] * 2, high, confidences=doubted) == [2, 2]
    mixed = budget(cost).plan([chain(8)] * 2, modest, confidences=[[1.0] * 8, None])  # None: the row's rate
    assert mixed[0] == 8


def test_confidence_is_calibrated_by_what_verification_accepts():
    """A drafter that claims certainty but is accepted a third of the time is priced at a third: where a token
    costs 0.4 of a plain step, its sure drafts stop being verified."""
    cost = lambda rows, width: 1.0 + 0.4 * (width - 1)  # noqa: E731
    assert max(budget(cost).plan([chain(8)], [AcceptanceEstimate()], confidences=[[1.0] * 8])) == 8
    b = budget(cost)
    for _ in range(40):
        b.observe(AcceptanceEstimate(), drafted=6, accepted=2, confidence=[1.0] * 6)
    assert b.calibration.scale() == pytest.approx(1 / 3, abs=0.02)
    assert b.calibration.priced([1.0, 0.5]) == pytest.approx([b.calibration.scale(), b.calibration.scale() / 2])
    assert b.plan([chain(8)], [AcceptanceEstimate()], confidences=[[1.0] * 8]) == [0]
    generous = SpeculationBudget().calibration
    generous.update(1.0, 3)  # accepted more than claimed: a node's price still stops at 1
    assert generous.priced([0.9]) == [1.0]


def test_with_nothing_waiting_a_plan_is_worth_the_critical_rows_tokens():
    """8 rows, one of them critical, acceptance 0.9, each width 30 % dearer than a plain step. Counting every row's
    tokens a one-node draft is worth (8 + 0.9) / 1.3 = 6.8 < 8 x 1.04 plain-step tokens, so it never pays; but the
    other rows' tokens come anyway, and the critical row's are the pass's length: (1 + 0.9) / 1.3 = 1.46 > 1.04."""
    b = budget(lambda rows, width: 1.0 + 0.3 * (width - 1), min_advantage=1.04)
    high = [AcceptanceEstimate(accepted=90, rejections=10)] * 8
    left = [100] + [20] * 7
    plan = b.plan([chain(4)] + [[]] * 7, high, critical=b.critical(left))
    assert plan[0] >= 1 and plan[1:] == [0] * 7
    assert b.plan([chain(4)] + [[]] * 7, high) == [0] * 8  # a queue waits: all tokens count, and it does not pay
    b.tail_rule = False
    assert b.critical(left) is None


def test_a_steps_worth_counts_the_critical_rows():
    assert step_worth([3, 1, 1, 1], [True] * 4) == 6  # every row counts: the tokens kept
    assert step_worth([3, 1, 1, 1], [True, False, False, False]) == 12  # 4 rows x the critical row's 3
    assert step_worth([1, 1, 1, 1], [True, False, True, False]) == 4  # a plain step: its rows, either way
    assert step_worth([5, 1], [False, False]) == 6


def test_exploring_waits_longer_after_explorations_that_found_nothing():
    """Drafts that are never accepted: the wait before exploring doubles from explore_every to explore_most; a
    draft accepted while exploring brings it back."""
    b = budget(lambda rows, width: float(width))  # the model never drafts: only exploring steps verify
    estimates = [AcceptanceEstimate(accepted=0, rejections=5)] * 4
    exploring = []
    for step in range(16 + 32 + 64 + 64):
        width = choose_width(b, [chain(4)] * 4, estimates)
        b.emitted(kept=4, accepted=0)
        if width > 1:
            exploring.append(step)
    assert exploring == [15, 15 + 32, 15 + 32 + 64, 15 + 32 + 64 + 64]
    assert choose_width(b, [chain(4)] * 4, estimates) == 1
    for _ in range(63):
        choose_width(b, [chain(4)] * 4, estimates)
        b.emitted(kept=4, accepted=0)
    assert b.idle_steps == 0 and b._wait() == 64  # (the 64th step explored)
    b.exploring = True
    b.emitted(kept=6, accepted=2)  # that exploring step accepted 2 tokens
    assert b._wait() == 16
    short = budget(lambda rows, width: float(width), explore_every=4)
    assert [choose_width(short, [chain(4)] * 4, estimates) for _ in range(4)] == [1, 1, 1, 2]


def test_steps_where_every_row_drafts_alike_put_the_cost_on_the_tokens():
    """Padded steps cannot tell the token slope from the width slope (x_token = x_width): the split is the priors'.
    Held at its prior, the width slope stays small, and one row drafting 4 tokens among 16 (a ragged step) is priced
    near what its 4 tokens cost, not like 4 widths of every row."""
    model = StepCostModel(prior_token=0.12, prior_width=0.03)
    model.observe(16, 1, 0.10, context=100)
    for _ in range(60):
        model.observe(16, 2, 0.10 * 1.45, context=100)  # all 16 rows verify one draft token: +45 %
    token, per_width = model.slopes(16, 100)
    assert 0.40 < token + per_width < 0.46  # (the pulls toward the priors shrink it a little)
    assert token > 0.35 and per_width < 0.07  # equal pulls: ~0.26 and ~0.17
    assert model.ratio(16, 5, 100, computed=20) < 1.3  # equal pulls would price it at ~1.8
    equal = StepCostModel(prior_token=0.12, prior_width=0.03, width_weight=1.0)
    equal.observe(16, 1, 0.10, context=100)
    for _ in range(60):
        equal.observe(16, 2, 0.10 * 1.45, context=100)
    assert equal.ratio(16, 5, 100, computed=20) > 1.6
