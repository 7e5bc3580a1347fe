"""The speculation budget: how many draft tokens each row verifies this step, from each row's acceptance and the
timed cost of the forward, so that speculation shrinks to plain batched decoding where drafts don't pay.

The batched forward feeds a [B, T] block, T = 1 + the longest draft verified. Its cost depends on T and on the
tokens it computes: B x T when padded, only the real ones when ragged_tokens.py skips the padding (a CPU, enough of
it). For a plan (k_r draft tokens for row r) the expected tokens are

    E = sum over rows r of  1 + a_r + a_r^2 + ... + a_r^k_r

(a_r = row r's per-token acceptance estimate; each accepted draft token is kept only if all before it were: the
usual geometric model, Leviathan et al. §3.1), and the cost is that of the step over a plain one, learned on this
machine (`StepCostModel`). The step takes the plan with the most expected tokens per unit of cost; no drafts at all
always competes, so a batch whose drafts are not accepted decodes as batched `ar` does. An optional token budget
caps B x T.

Costs are timed, not assumed, and on a CPU never with throw-away forwards: every step's wall time feeds
`StepCostModel`, learned per (batch size bucket (1, 2, 4, ..., 64), context bucket (256, 1,024, 4,096, ... cached
positions)). The context matters: a long cache makes every step pay for attention whatever its width, so extra tokens
cost relatively less (what one table per batch bucket got wrong: docs/decisions.md). Where a device's steps are
captured (a GPU), a timed step is one graph replay: the decoder times widths 1 to 8 when it meets a new bucket
(`StepCostModel.calibrate`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..model.ragged_tokens import MAX_REAL_SHARE
from .expected_gains import best_width as compiled_best_width, cuts, expected_gains

PRIOR_WEIGHT = 2.0  # pseudo-observations pulling a new row's acceptance toward the decoder's pooled estimate


def batch_bucket(rows: int) -> int:
    """The power of two at or above `rows` (cost ratios are learned per bucket)."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


def context_bucket(positions: int) -> int:
    """256, 1,024, 4,096, ...: the first at or above the longest row's cached positions (x4 steps keep the number of
    calibrations small; within a bucket the ratios move little)."""
    bucket = 256
    while bucket < positions:
        bucket *= 4
    return bucket


def computed_tokens(rows: int, width: int, real: int, ragged: bool, max_real_share: float = MAX_REAL_SHARE) -> int:
    """Tokens a [rows, width] forward with `real` real ones computes: the real ones where the forward gathers them
    (at most `max_real_share` of the block real: the target's ModelRunner.gather_share), else the padded block."""
    if ragged and width > 1 and real <= max_real_share * rows * width:
        return real
    return rows * width


@dataclass
class AcceptanceEstimate:
    """Accepted draft tokens and rejections: a = accepted / (accepted + rejections) under the geometric model."""

    accepted: float = 0.0
    rejections: float = 0.0
    idle: int = 0  # steps in a row this row proposed but was planned no draft (SpeculationBudget.plan explores it)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted += accepted
        self.rejections += accepted < drafted

    def rate(self, prior: float) -> float:
        total = self.accepted + self.rejections
        return (self.accepted + PRIOR_WEIGHT * prior) / (total + PRIOR_WEIGHT)


@dataclass
class ConfidenceCalibration:
    """How a drafter's own confidence (Draft.confidence) compares with what verification accepts: accepted draft
    tokens over the confidence summed over the verified nodes (their expected accepted tokens), both decayed. A node
    is priced at min(1, scale x its confidence)."""

    predicted: float = 0.0
    accepted: float = 0.0
    decay: float = 0.98  # weight kept by earlier steps' sums at each new one (confidence drifts with the text)

    def update(self, predicted: float, accepted: int) -> None:
        if predicted <= 0:
            return
        self.predicted = self.decay * self.predicted + predicted
        self.accepted = self.decay * self.accepted + accepted

    def scale(self) -> float:
        """accepted / predicted, pulled toward 1 (the drafter taken at its word) by PRIOR_WEIGHT tokens."""
        return (self.accepted + PRIOR_WEIGHT) / (self.predicted + PRIOR_WEIGHT)

    def priced(self, confidence: list[float]) -> list[float]:
        scale = self.scale()
        return [min(1.0, scale * p) for p in confidence]


def critical_rows(left: list[int], saved_share: float) -> list[bool]:
    """Which rows can still set the pass's length when nothing waits for a slot: those with at least the most tokens
    left (left[r]) less the share of it that speculation could still save, `saved_share` = the share of the pass's
    tokens that accepted drafts gave so far.

    With a queue, every token a step emits is work done and the budget counts them all. With none, the pass lasts as
    long as its longest row, and a token accepted on a row far ahead of it shortens nothing: its verify only costs
    (decisions.md: specdec_core/loop/speculation_budget.py). A row within the
    margin may still become the longest one, so it keeps drafting."""
    if not left:
        return []
    longest = max(left)
    margin = max(1, math.ceil(saved_share * longest))
    return [n >= longest - margin for n in left]


def step_worth(kept: list[int], counts: list[bool]) -> float:
    """What a step's tokens were worth to the pass: kept[r] = the tokens row r kept, counts[r] = whether its tokens
    count (SpeculationBudget.critical). Every row counting: the tokens kept. Else the rows times the mean the
    counted rows kept, so that a plain step is worth its rows either way and the clock's check (MeasuredPayoff)
    compares what the plan valued."""
    counted = [n for n, keep in zip(kept, counts) if keep]
    if not counted or len(counted) == len(kept):
        return float(sum(kept))
    return len(kept) * sum(counted) / len(counted)


def expected_tokens(rate: float, draft_len: int) -> float:
    """1 + a + ... + a^k: expected tokens a step emits for a row drafting k tokens (the target's own included).
    Closed form: this runs for every row and candidate width of every step."""
    if rate >= 1.0:
        return float(draft_len + 1)
    return (1.0 - rate ** (draft_len + 1)) / (1.0 - rate)


@dataclass
class StepCostModel:
    """cost of a step / cost of a plain step = 1 + s_token x (computed - B) / B + s_width x (T - 1), learned per
    (batch bucket, context bucket) from the decode steps themselves: no forward is ever spent on measuring.

    B = rows, T = the step's width, computed = the tokens the forward multiplies through its linear layers: B x T
    when the step is padded, only the real ones (B + the drafts verified) when ragged_tokens.py skips the padding.
    s_token prices the linear layers' work per extra token (averaged over the rows); s_width what grows with the
    padded width whatever is real (attention over [B, T] queries, norms, masks).

    Why this form: on a CPU a step pays a fixed part (reading the weights, attention over the cache) plus a part per
    token computed, and one slope per width cannot tell a step where 4 rows draft from one where 16 do. Why online:
    every step's seconds are real work, so each wide step refines the fit at the widths the budget uses, and no
    throw-away calibration forward is paid for (the measurements behind both: docs/decisions.md).

    Estimator: ridge regression of (seconds / plain seconds - 1) on the two features, sums decayed by `decay` per wide
    step, pulled toward the priors by one pseudo-observation for s_token and `width_weight` for s_width; a coefficient
    that comes out negative is dropped and the other refitted alone. Steps where every row drafts alike cannot
    separate the two (x_token = x_width there): then the pull decides the split, and the heavier one on s_width puts
    the cost on the tokens, which is where it is wherever the split matters (a ragged forward computes real tokens
    only; measured: docs/decisions.md). Steps where some rows draft less than others tell them apart. The unit is a
    plain step's seconds (EMA) at the same row count; a wide step with no plain step timed at its row count is not
    learned from (a plain step of other rows would misprice it), and prices are read at the nearest row count timed.
    A bucket with no wide step yet borrows the fit of a bucket with at least as many rows and at most as long a
    context (at least as steep, so borrowing can only under-speculate), else starts from the priors.
    """

    plain_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, context bucket) -> EMA seconds
    sums: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # bucket -> [xx11, xx12, xx22, xy1, xy2]
    prior_token: float = 0.12  # this AVX2 CPU ~0.3, the bf16 CPU and GPUs far less: corrected within steps
    prior_width: float = 0.03
    width_weight: float = 16.0  # pseudo-observations holding s_width at its prior (s_token: 1)
    alpha: float = 0.25  # EMA weight of a new plain step
    decay: float = 0.9  # weight kept by older wide-step observations at each new one
    fixed: Callable[[int, int], float] | None = None  # tests: a known cost function of (rows, width) instead

    def ratio(self, rows: int, width: int, context: int = 0, computed: int | None = None) -> float:
        """Cost of a step of `rows` rows, width `width` and `computed` tokens (None: padded, rows x width) in
        plain steps."""
        if self.fixed is not None:
            return self.fixed(rows, width) / self.fixed(rows, 1)
        if width <= 1:
            return 1.0
        computed = rows * width if computed is None else computed
        return self._linear(rows, width, context, computed)

    def ratios(self, rows: int, widths: np.ndarray, context: int, computed: np.ndarray) -> np.ndarray:
        """`ratio` of each of several steps of `rows` rows: widths [W] (each > 1) and computed tokens [W]."""
        if self.fixed is not None:
            return np.array([self.ratio(rows, int(w), context, int(c)) for w, c in zip(widths, computed)])
        return self._linear(rows, widths, context, computed)

    def _linear(self, rows: int, width, context: int, computed):
        """The learned cost of a step wider than 1, in plain steps (width, computed: numbers or arrays alike)."""
        token, per_width = self.slopes(rows, context)
        return 1.0 + token * (computed - rows) / rows + per_width * (width - 1)

    def token_seconds(self, rows: int, context: int = 0) -> float:
        """Seconds one more verified token adds to a step of `rows` rows (s_token x a plain step / rows; 0 before a
        plain step was timed)."""
        if self.fixed is not None:
            return 0.0
        plain = self._plain(rows, context)
        return 0.0 if plain is None else self.slopes(rows, context)[0] * plain / max(rows, 1)

    def knows_plain(self, rows: int, context: int = 0) -> bool:
        """Whether a plain step was timed in this (batch bucket, context bucket): the unit every ratio is in."""
        return self.fixed is not None or self._plain(rows, context) is not None

    def _plain(self, rows: int, context: int) -> float | None:
        bucket, where = batch_bucket(rows), context_bucket(context)
        timed = [n for (n, c) in self.plain_s if c == where and batch_bucket(n) == bucket]
        if not timed:
            return None
        return self.plain_s[(min(timed, key=lambda n: (abs(n - rows), -n)), where)]

    def slopes(self, rows: int, context: int = 0) -> tuple[float, float]:
        """(s_token, s_width) for this bucket."""
        bucket = (batch_bucket(rows), context_bucket(context))
        if bucket not in self.sums:
            usable = [key for key in self.sums if key[0] >= bucket[0] and key[1] <= bucket[1]]
            if not usable:
                return self.prior_token, self.prior_width
            bucket = min(usable, key=lambda key: (key[0], -key[1]))
        xx11, xx12, xx22, xy1, xy2 = self.sums[bucket]
        # Ridge toward the priors: (X'X + diag(1, width_weight)) s = X'y + diag(1, width_weight) prior.
        a11, a12, a22 = xx11 + 1.0, xx12, xx22 + self.width_weight
        b1, b2 = xy1 + self.prior_token, xy2 + self.width_weight * self.prior_width
        det = a11 * a22 - a12 * a12
        token, per_width = (a22 * b1 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det
        if token < 0:
            return 0.0, max(0.0, b2 / a22)
        if per_width < 0:
            return max(0.0, b1 / a11), 0.0
        return token, per_width

    def observe(self, rows: int, width: int, seconds: float, context: int = 0, computed: int | None = None) -> None:
        """A finished step's wall time (forward + verification) at this width and computed token count."""
        if seconds <= 0 or self.fixed is not None:
            return
        where = context_bucket(context)
        if width == 1:
            old = self.plain_s.get((rows, where))
            self.plain_s[(rows, where)] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
            return
        plain = self.plain_s.get((rows, where))
        if plain is None:
            # No unit at this row count yet (a plain step in the bucket comes first, SpeculationBudget.plan; after
            # rows retire, a probe times one): a plain step of other rows would misprice this one.
            return
        x1 = ((rows * width if computed is None else computed) - rows) / rows
        x2, y = float(width - 1), seconds / plain - 1.0
        sums = self.sums.setdefault((batch_bucket(rows), where), [0.0] * 5)
        for i, term in enumerate((x1 * x1, x1 * x2, x2 * x2, x1 * y, x2 * y)):
            sums[i] = self.decay * sums[i] + term

    def calibrate(self, rows: int, context: int, ratios: dict[int, float]) -> None:
        """Steps timed on purpose at `rows` rows: ratios[width] = a padded step's seconds at that width over a plain
        step's (graph_step.GraphStep.time_widths, where a device's steps are captured). Each counts as one
        observation of this (batch bucket, context bucket), so the first wide steps are priced by the device
        rather than by the priors; the steps that follow refine the fit as before."""
        if self.fixed is not None:
            return
        sums = self.sums.setdefault((batch_bucket(rows), context_bucket(context)), [0.0] * 5)
        for width, ratio in sorted(ratios.items()):
            if width <= 1 or ratio <= 0:
                continue
            x, y = float(width - 1), ratio - 1.0  # padded: the extra tokens a row and the extra width are one
            for i, term in enumerate((x * x, x * x, x * x, x * y, x * y)):
                sums[i] = self.decay * sums[i] + term


@dataclass
class MeasuredPayoff:
    """Checks the model against the clock: tokens per second of the steps that verified drafts against those of
    plain width-1 steps, per batch bucket, and scales the extra cost of width (`penalty`) until drafting pays.

    The geometric acceptance model and the calibrated cost table can both be wrong in ways that only show in the
    wall time: copied drafts are all-or-nothing rather than geometric, and a CPU's step cost can grow almost in
    proportion to the tokens verified (docs/decisions.md). So every step's (width, tokens, seconds) is recorded; when speculative steps deliver fewer
    tokens per second than plain ones, the cost of every wider step is multiplied by a penalty that grows x1.25 per
    losing step (so within a few steps the budget decodes plainly), and decays back toward 1 when they win (/1.1) and
    slowly while only plain steps run (/1.02, so drafting is tried again later). A plain step is forced now and then
    (`probe_due`) so that the comparison stays current as the context grows: every 8 steps while the two are close,
    every 32 when drafting clearly pays."""

    alpha: float = 0.25  # EMA weight of a new step
    penalty: dict[int, float] = field(default_factory=dict)  # batch bucket -> multiplier of a wider step's cost
    plain_rate: dict[int, float] = field(default_factory=dict)  # batch bucket -> EMA tokens/s of width-1 steps
    spec_rate: dict[int, float] = field(default_factory=dict)  # batch bucket -> EMA tokens/s of wider steps
    since_plain: dict[int, int] = field(default_factory=dict)  # batch bucket -> steps since the last width-1 step

    def record(self, rows: int, width: int, tokens: float, seconds: float) -> None:
        if seconds <= 0:
            return
        bucket, rate = batch_bucket(rows), tokens / seconds
        target = self.plain_rate if width == 1 else self.spec_rate
        target[bucket] = rate if bucket not in target else (1 - self.alpha) * target[bucket] + self.alpha * rate
        self.since_plain[bucket] = 0 if width == 1 else self.since_plain.get(bucket, 0) + 1
        penalty = self.penalty.get(bucket, 1.0)
        if width == 1:
            penalty = max(1.0, penalty / 1.02)
        elif bucket in self.plain_rate:
            losing = self.spec_rate[bucket] < self.plain_rate[bucket]
            penalty = min(16.0, penalty * 1.25) if losing else max(1.0, penalty / 1.1)
        self.penalty[bucket] = penalty

    def probe_due(self, rows: int) -> bool:
        bucket = batch_bucket(rows)
        if bucket not in self.plain_rate:
            return self.since_plain.get(bucket, 0) >= 2  # measure plain steps early
        clear_win = self.spec_rate.get(bucket, 0.0) > 1.3 * self.plain_rate[bucket]
        return self.since_plain.get(bucket, 0) >= (32 if clear_win else 8)

    def scaled(self, rows: int, ratio: float | np.ndarray) -> float | np.ndarray:
        """The cost ratio of a step wider than 1, as the clock has judged such steps so far."""
        return ratio * self.penalty.get(batch_bucket(rows), 1.0)


@dataclass
class DraftPricing:
    """What one more drafted token costs and what a token is worth, in seconds, timed as the decoder runs: the
    price a draft model's confidence stop (`draft_confidence="priced"`) compares its draft's probability with.

    A row drafting its (k+1)-th token pays one draft-model forward, shared by the rows still drafting at that
    position (`drafting_rows`, set by the pool), and one more token verified in the target's step; it gains P_k
    tokens in expectation (P_k = the drafter's probability of the draft so far, close to the acceptance rate). In
    seconds per token the decoder emits (token_s), drafting pays while
    P_k >= (forward_s / drafting_rows + verify_s) / token_s: the decoder's own rate is the bar a token must beat.
    Why the rows still drafting and not an average share: a draft-model forward costs about the same for 1 row as
    for 8 on a CPU, so the last row drafting pays for all of it. Against fixed floors, the price follows the
    drafter's dtype, the batch and the machine (docs/decisions.md).
    """

    alpha: float = 0.2  # EMA weight of a new observation
    forward_s: float | None = None  # seconds of a draft-model forward (one token per row)
    drafting_rows: int = 1  # rows still drafting at the position being drafted (set by the pool)
    verify_s: float = 0.0  # seconds one more verified token adds to the step (set by the decoder each step)
    step_s: float | None = None  # EMA of the decode steps' seconds (drafting, forward, verification) ...
    step_tokens: float | None = None  # ... and of the tokens they emitted: their ratio is the decoder's rate
    prefill_s: float = 0.0  # this step's draft-model prompt catch-ups: prefill, not the price of drafting

    @property
    def token_s(self) -> float | None:
        """Seconds per token the decode steps emit: a ratio of averages (an average of each step's seconds per
        token is dominated by the steps that emitted one token)."""
        if self.step_s is None or not self.step_tokens:
            return None
        return self.step_s / self.step_tokens

    def record_step(self, tokens: int, seconds: float) -> None:
        """A decode step's tokens and seconds; the draft model's prompt catch-ups in it (`record_prefill`) are left
        out: counted, they price a request's first drafts too cheaply."""
        seconds, self.prefill_s = seconds - self.prefill_s, 0.0
        if seconds > 0:
            self.step_s = self._ema(self.step_s, seconds)
            self.step_tokens = self._ema(self.step_tokens, float(tokens))

    def record_prefill(self, seconds: float) -> None:
        self.prefill_s += seconds

    def record_forward(self, seconds: float) -> None:
        if seconds > 0:
            self.forward_s = self._ema(self.forward_s, seconds)

    def floor(self) -> float | None:
        """The draft probability below which one more drafted token costs more than it returns (None: not yet
        timed). At least 0.02; 1 or more = only a certain token would pay."""
        if self.token_s is None or self.forward_s is None:
            return None
        return max(0.02, (self.forward_s / max(1, self.drafting_rows) + self.verify_s) / self.token_s)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new


@dataclass
class SpeculationBudget:
    """Chooses each step's width; `observe` learns every row's acceptance and the decoder's pooled acceptance."""

    cost: StepCostModel = field(default_factory=StepCostModel)
    token_budget: int | None = None  # most B x T tokens per forward (padding included); None = no cap
    enabled: bool = True  # False: verify every draft as proposed (still capped by token_budget)
    pooled: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # Tokens from accepted drafts (`accepted`) against the other tokens emitted (`rejections`): the share of the
    # pass's tokens that speculation saved a step for (the tail rule's margin, `critical_rows`).
    saved: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    planning_s: float = 0.0  # time spent choosing widths
    payoff: MeasuredPayoff = field(default_factory=MeasuredPayoff)
    check_payoff: bool = True  # False: trust the model alone (tests with a fixed cost function)
    # Exploration: after this many steps in a row that had drafts but verified none, verify one token per row.
    # Without it a batch whose first drafts were rejected never verifies again (its acceptance estimates have no
    # way back up; docs/decisions.md).
    explore_every: int = 16
    # An exploring step whose drafts were all rejected doubles the wait before the next one, up to this many steps;
    # one that accepted a token brings it back to explore_every. Drafts that are never accepted (a drafter with
    # nothing to retrieve) then cost a few verified tokens in a pass, not one per row every 16 steps
    # (docs/decisions.md).
    explore_most: int = 64
    explore_wait: int = 0  # the steps now waited before exploring, when more than explore_every
    exploring: bool = False  # the last plan was an exploring step, not yet emitted
    idle_steps: int = 0
    # Resting: after this many refused steps the rows stop proposing until the next exploring step (proposals
    # nobody verifies are pure cost; docs/decisions.md).
    # A rested step counts as a refused one, so exploration keeps its cadence. 0 = never rest.
    rest_after: int = 4
    # A drafting plan must promise this much more than a plain step (1.04: 4 % more tokens per unit of cost). Near
    # break-even the choice is a coin flip on estimates that lean optimistic (a row's acceptance starts from the
    # pooled prior; the first wide steps are priced by priors); plans that pay clearly are far above it
    # (docs/decisions.md).
    min_advantage: float = 1.04
    # Whether the target's forwards compute real tokens only (ragged_tokens.py): then a row's drafts cost what it
    # verifies, not the padded width times every row (`for_target` reads it from the target).
    ragged: bool = False
    gather_share: float = MAX_REAL_SHARE  # the share of real tokens under which it gathers them (set with `ragged`)
    pricing: DraftPricing = field(default_factory=DraftPricing)  # what a drafted token costs and a token is worth
    calibration: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)  # of drafts' own confidence
    # With nothing waiting for a slot, only rows that can still set the pass's length draft (`plan`'s `left`).
    # False: every row's tokens count as work done then too (benchmarks compare the two).
    tail_rule: bool = True

    @classmethod
    def for_target(cls, target, **settings) -> "SpeculationBudget":
        """A budget that prices the forwards of `target` (a ModelRunner): padded or ragged, and its gather share."""
        return cls(ragged=target.ragged is not None, gather_share=target.gather_share, **settings)

    def drafting_due(self) -> bool:
        """Whether the rows should propose drafts this step (False while speculation rests)."""
        if not self.rests_next():
            return True
        self.idle_steps += 1
        return False

    def rests_next(self) -> bool:
        """Whether the next drafting_due() says no (asking changes nothing)."""
        if not self.enabled or not self.rest_after or not self.explore_every or self.idle_steps < self.rest_after:
            return False  # (without exploration a rest would never end)
        return self.idle_steps + 1 < self._wait()  # (else that step explores: it needs drafts)

    def most_nodes(self, rows: int) -> int:
        """The most draft nodes a row may verify in a step of `rows` rows under the token budget (B x T)."""
        if self.token_budget is None:
            return 1 << 30
        return max(1, self.token_budget // max(rows, 1)) - 1

    def critical(self, left: list[int]) -> list[bool] | None:
        """With no request waiting for a slot, `left[r]` = the tokens row r has left: which rows can still set the
        pass's length (`critical_rows`, with the share of the pass's tokens accepted drafts gave so far, `saved`).
        None where every row's tokens count (the tail rule off, or the budget)."""
        if not (self.enabled and self.tail_rule):
            return None
        return critical_rows(left, self.saved.rate(prior=0.5))

    def plan(self, reaches: list[list[int]], estimates: list[AcceptanceEstimate], context: int = 0,
             critical: list[bool] | None = None, confidences: list[list[float] | None] | None = None) -> list[int]:
        """Draft nodes each row verifies this step (0 = none). reaches[r][n - 1] = the deepest path row r's draft
        cut to n nodes can accept (a chain: n; a tree: less than its node count), so len(reaches[r]) is its
        proposal. `context` = the longest live row's cached positions (costs are learned per context bucket).

        Two kinds of plan compete for every width T: each row drafting min(proposal, T - 1), and the same with each
        row cut where its next node would add less than it costs. A node deepening row r's path to depth d adds
        a_r^d expected tokens; when the forward computes real tokens only (`ragged`), it costs s_token / B plain
        steps, so it pays while a_r^d >= V x s_token / B, V being the step's tokens per plain step (first B, the
        plain step's; then the best plan's). A row whose drafts are seldom accepted then verifies none while its
        neighbours verify long ones, at the price of their tokens only. The plan with the most expected tokens per
        unit of cost wins; all zeros (a plain step, value B) always competes.

        `critical`: with no request waiting for a slot, the rows that can still set the pass's length (`critical`;
        None: a queue keeps the slots full and every token emitted is work done). Then only they draft, and a plan
        is worth the critical rows' tokens alone: the others' tokens come in this step whatever it verifies, and
        finishing them sooner shortens nothing, while each step a critical row saves is a whole step of the pass
        (the plain step's value and the cut's bar are the critical rows' count, not the batch's).

        `confidences[r]`: row r's draft's own per-node acceptance (Draft.confidence) or None. Such a row's node n
        adds its calibrated confidence (`calibration`) instead of a_r^depth: a suffix tree knows that a continuation
        seen 9 times of 10 is likelier than one seen once, which one rate per row cannot say."""
        rows = len(reaches)
        counted = rows
        if critical is not None and self.enabled:
            reaches = [reach if keep else [] for reach, keep in zip(reaches, critical)]
            counted = max(1, sum(critical))
        lengths = [len(reach) for reach in reaches]
        longest = min(max(lengths, default=0), self.most_nodes(rows))
        if longest <= 0:
            return [0] * rows
        if not self.enabled:
            return [min(n, longest) for n in lengths]
        if self.check_payoff and (self.payoff.probe_due(rows) or not self.cost.knows_plain(rows, context)):
            return [0] * rows  # a plain step now and then keeps the timed comparison (and the cost unit) current
        started = time.perf_counter()
        prior = self.pooled.rate(prior=0.5)
        priced = None if confidences is None else [
            None if c is None else self.calibration.priced(c) for c in confidences]
        # [R, longest + 1]: what each row's first n nodes add, each row's last sum repeated past its nodes
        gained, deepening = expected_gains(reaches, [e.rate(prior) for e in estimates], longest, priced)
        best, best_value = self._best_width(lengths, gained, counted, context, longest, [0] * rows,
                                            float(counted) * self.min_advantage)
        token_slope = self.cost.slopes(rows, context)[0] if self.cost.fixed is None else 0.0
        if self.check_payoff:
            token_slope *= self.payoff.penalty.get(batch_bucket(rows), 1.0)  # the clock's verdict on wide steps
        if self.ragged and token_slope > 0:
            for bar in (float(counted), None):  # the plain step's bar, then the best plan's
                limits = cuts(deepening, (best_value if bar is None else bar) * token_slope / rows)
                best, best_value = self._best_width([min(n, cut) for n, cut in zip(lengths, limits)], gained, counted,
                                                    context, longest, best, best_value)
        self.planning_s += time.perf_counter() - started
        return self._explore(best, lengths, estimates)

    def _best_width(self, caps: list[int], gained: np.ndarray, counted: int, context: int, longest: int,
                    best: list[int], best_value: float) -> tuple[list[int], float]:
        """Every width's plan with row r drafting at most caps[r], against the best so far -> the better one (the
        first of equal values). gained [R, longest + 1]: expected tokens of row r's first n nodes. In arrays over
        the widths and rows, not Python loops: a GPU's step waits for the host's plan."""
        caps = np.minimum(np.asarray(caps, dtype=np.int64), longest)  # [R]
        top = int(caps.max(initial=0))
        if top == 0:
            return best, best_value
        rows = len(caps)
        scale = self.payoff.scaled(rows, 1.0) if self.check_payoff else 1.0  # (the numpy path's `scaled` below)
        nodes, value = compiled_best_width(caps, gained, counted, None if self.cost.fixed is not None else
                                           self.cost.slopes(rows, context), scale,
                                           self.gather_share if self.ragged else None)
        if nodes > 0:  # (compiled: the numpy below, in loops)
            return (np.minimum(caps, nodes).tolist(), value) if value > best_value else (best, best_value)
        plans = np.minimum(caps[None, :], np.arange(1, top + 1)[:, None])  # [W, R]: widths 2 .. top + 1
        # [W]; the rows summed in order, as the compiled path does (numpy sums a contiguous axis pairwise)
        tokens = counted + np.ascontiguousarray(np.take_along_axis(gained, plans.T, axis=1)).sum(axis=0)
        widths = np.arange(2, top + 2)  # [W] (wider plans repeat the widest, at the same value)
        real = rows + plans.sum(axis=1)  # [W]
        padded = rows * widths
        computed = np.where(real <= self.gather_share * padded, real, padded) if self.ragged else padded
        ratios = self.cost.ratios(rows, widths, context, computed)
        if self.check_payoff:
            ratios = self.payoff.scaled(rows, ratios)
        values = tokens / ratios
        index = int(values.argmax())
        if values[index] > best_value:
            return plans[index].tolist(), float(values[index])
        return best, best_value

    def _explore(self, best: list[int], lengths: list[int], estimates: list[AcceptanceEstimate]) -> list[int]:
        """After the exploring wait (explore_every steps, more after explorations that found nothing) in which nobody
        drafts, one node per drafting row: every estimate gets a fresh
        look. A row cut to nothing while others draft learns nothing either (its estimate sees no draft): after
        explore_every such steps it verifies one node."""
        self.idle_steps = self.idle_steps + 1 if not any(best) else 0
        if self.explore_every and self.idle_steps >= self._wait():
            self.idle_steps = 0
            self.exploring = True
            return [min(n, 1) for n in lengths]
        if self.explore_every and any(best):
            seen = set()
            for r, estimate in enumerate(estimates):
                if id(estimate) in seen:
                    continue
                seen.add(id(estimate))
                estimate.idle = estimate.idle + 1 if lengths[r] and not best[r] else 0
                if estimate.idle >= self.explore_every:
                    estimate.idle = 0
                    best[r] = 1
        return best

    def record_step(self, rows: int, width: int, tokens: float, seconds: float, context: int = 0,
                    real: int | None = None, drafting_s: float = 0.0) -> None:
        """A finished step: its width, the tokens its rows kept (or, where only the critical rows count, the rows
        times what those kept on average: what the plan valued) and its wall time (forward + verification);
        `context` as for `plan` (the longest row's cached positions before the step); `real` = the tokens fed
        (rows + drafts verified; None: rows x width); `drafting_s` = the seconds its drafters took (draft-model
        prompt catch-ups left out: prefill). The clock's check counts the drafting, the target's cost model does
        not: a draft model's forwards are no part of the target's step, but a step that drafted did pay for them
        (why the catch-ups are left out: docs/decisions.md)."""
        computed = None if real is None else computed_tokens(rows, width, real, self.ragged, self.gather_share)
        self.cost.observe(rows, width, seconds, context, computed)
        if self.enabled and self.check_payoff:
            self.payoff.record(rows, width, tokens, seconds + max(0.0, drafting_s))

    def emitted(self, kept: int, accepted: int) -> None:
        """A step's rows kept `kept` tokens, `accepted` of them from their drafts (`saved`); after an exploring
        step, what it found sets the wait before the next one (explore_most)."""
        self.saved.accepted += accepted
        self.saved.rejections += kept - accepted
        if self.exploring:
            self.exploring = False
            self.explore_wait = 0 if accepted else min(self.explore_most, 2 * self._wait())

    def _wait(self) -> int:
        """Steps with drafts but nothing verified before the next exploring step."""
        return max(self.explore_every, self.explore_wait)

    def observe(self, estimate: AcceptanceEstimate, drafted: int, accepted: int,
                confidence: list[float] | None = None) -> None:
        """A row's verified draft: `drafted` deep, `accepted` of it accepted; `confidence`: its verified nodes' own
        (Draft.confidence), which the calibration compares with what was accepted."""
        estimate.update(drafted, accepted)
        self.pooled.update(drafted, accepted)
        if confidence is not None:
            self.calibration.update(sum(confidence), accepted)
