"""The speculation budget: how many tokens each row may verify this step, from each row's acceptance and the
measured cost of a `[B, T]` forward, so that speculation shrinks to plain batched decoding where drafts don't pay.

The batched forward is padded: every row computes T = 1 + the longest draft tokens, so the choice is one step width
T for the batch (rows draft min(own proposal, T - 1)). For each candidate T the expected tokens this step are

    E(T) = sum over rows r of  1 + a_r + a_r^2 + ... + a_r^k_r,   k_r = min(len(draft_r), T - 1)

(a_r = row r's per-token acceptance estimate; each accepted draft token is kept only if all before it were: the
usual geometric model, Leviathan et al. §3.1), and the cost is cost(B, T) / cost(B, 1), measured on this machine.
The step takes the T with the most expected tokens per unit of cost; T = 1 (no drafts) always competes, so a batch
whose drafts are not accepted decodes as batched `ar` does. An optional token budget caps B x T.

Costs are measured, not assumed, and never with throw-away forwards: every step's wall time feeds `StepCostModel`,
an affine cost per extra token of width learned per (batch size bucket (1, 2, 4, ..., 64), context bucket (256,
1,024, 4,096, ... cached positions)). The context matters: a long cache makes every step pay for attention whatever
its width, so extra tokens cost relatively less. Measured on the avx512_bf16 CPU (SmolLM2, batch 16): with one table
per batch bucket, calibrated on ~1,000-token code prompts, speculation on ~150-token open questions ran at
0.78-0.89x batched ar (steps 1.5x dearer than the table said); 16 rows of 9 tokens cost ~1.2x 16 rows of 1 token
there. On this AVX2-only CPU in fp32 the same is ~2.6x; on a GPU the ratio stays near 1 up to much larger B x T.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

PRIOR_WEIGHT = 2.0  # pseudo-observations pulling a new row's acceptance toward the decoder's pooled estimate


def batch_bucket(rows: int) -> int:
    """The power of two at or above `rows` (cost ratios are measured per bucket)."""
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


@dataclass
class AcceptanceEstimate:
    """Accepted draft tokens and rejections: a = accepted / (accepted + rejections) under the geometric model."""

    accepted: float = 0.0
    rejections: float = 0.0

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted += accepted
        self.rejections += accepted < drafted

    def rate(self, prior: float) -> float:
        total = self.accepted + self.rejections
        return (self.accepted + PRIOR_WEIGHT * prior) / (total + PRIOR_WEIGHT)


def expected_tokens(rate: float, draft_len: int) -> float:
    """1 + a + ... + a^k: expected tokens a step emits for a row drafting k tokens (the target's own included).
    Closed form: this runs for every row and candidate width of every step."""
    if rate >= 1.0:
        return float(draft_len + 1)
    return (1.0 - rate ** (draft_len + 1)) / (1.0 - rate)


@dataclass
class StepCostModel:
    """cost(B, T) / cost(B, 1) = 1 + slope x (T - 1) per (batch bucket, context bucket), learned from the decode
    steps themselves: no forward is ever spent on measuring.

    Why affine: on a CPU a step pays a fixed part (reading the weights, attention over the cache) plus a part per
    token computed. Calibrated on this AVX2-only CPU (fp32, SmolLM2, 16 rows, ~1,000 cached tokens): ratios 1.18 /
    1.53 / 1.85 / 2.60 / 4.47 at T = 2 / 3 / 5 / 9 / 17, i.e. a slope of 0.18-0.26 per token, 0.22 end to end.
    Why online: the calibration this replaced ran 13 throw-away forwards of widths up to 17 per bucket, which cost
    5.5-8.5 s of a 55-75 s batch-16 pass (10-12 %): alone enough to put pld at 0.90x batched `ar` on summaries.
    Every step's seconds are real work, so each wide step also refines the slope at the widths the budget uses (on a
    GPU, flat at small T and steeper later, the slope is learned where it matters and corrected when T grows).

    Estimator: slope = sum of (ratio - 1) over sum of (T - 1) across the observed wide steps, decayed per step, so a
    wide step weighs more than a noisy T = 2 one; a plain step's seconds (EMA) is the unit. A bucket with no wide step
    yet borrows the slope of a bucket with at least as many rows and at most as long a context (its slope is at
    least as steep, so borrowing can only under-speculate), else starts from `prior_slope`.
    """

    plain_s: dict[tuple[int, int], float] = field(default_factory=dict)  # bucket -> EMA seconds of a plain step
    extra: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # bucket -> [sum ratio-1, sum T-1]
    prior_slope: float = 0.15  # between the bf16 CPU's 0.04-0.19 and this AVX2 CPU's 0.22: corrected within steps
    alpha: float = 0.25  # EMA weight of a new plain step
    decay: float = 0.9  # weight kept by older wide-step observations at each new one
    fixed: Callable[[int, int], float] | None = None  # tests: a known cost function instead of measurements

    def ratio(self, rows: int, width: int, context: int = 0) -> float:
        if self.fixed is not None:
            return self.fixed(rows, width) / self.fixed(rows, 1)
        if width <= 1:
            return 1.0
        return 1.0 + self.slope(rows, context) * (width - 1)

    def knows_plain(self, rows: int, context: int = 0) -> bool:
        """Whether a plain step was timed in this bucket (the unit every ratio is measured in)."""
        return self.fixed is not None or (batch_bucket(rows), context_bucket(context)) in self.plain_s

    def slope(self, rows: int, context: int = 0) -> float:
        bucket = (batch_bucket(rows), context_bucket(context))
        if bucket not in self.extra:
            usable = [key for key in self.extra if key[0] >= bucket[0] and key[1] <= bucket[1]]
            if not usable:
                return self.prior_slope
            bucket = min(usable, key=lambda key: (key[0], -key[1]))
        ratio_sum, width_sum = self.extra[bucket]
        return max(0.0, ratio_sum / width_sum)

    def observe(self, rows: int, width: int, seconds: float, context: int = 0) -> None:
        """A finished step's wall time (forward + verification) at this width."""
        if seconds <= 0 or self.fixed is not None:
            return
        bucket = (batch_bucket(rows), context_bucket(context))
        if width == 1:
            old = self.plain_s.get(bucket)
            self.plain_s[bucket] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
            return
        plain = self.plain_s.get(bucket)
        if plain is None:
            return  # no unit yet: a plain step in this bucket comes first (MeasuredPayoff.probe_due)
        sums = self.extra.setdefault(bucket, [self.prior_slope, 1.0])  # the prior counts as one token's worth
        sums[0] = self.decay * sums[0] + max(0.0, seconds / plain - 1.0)
        sums[1] = self.decay * sums[1] + (width - 1)


@dataclass
class MeasuredPayoff:
    """Checks the model against the clock: tokens per second of the steps that verified drafts against those of
    plain width-1 steps, per batch bucket, and scales the extra cost of width (`penalty`) until drafting pays.

    The geometric acceptance model and the calibrated cost table can both be wrong in ways that only show in the
    wall time: copied drafts are all-or-nothing rather than geometric, and on a CPU whose step cost grows almost in
    proportion to the tokens verified (measured: AVX2-only, fp32, summaries, batch 16), pld ran at 0.90x batched ar
    with the model alone. So every step's (width, tokens, seconds) is recorded; when speculative steps deliver fewer
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

    def record(self, rows: int, width: int, tokens: int, seconds: float) -> None:
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

    def scaled(self, rows: int, ratio: float) -> float:
        """The cost ratio of a step wider than 1, as the clock has judged such steps so far."""
        return ratio * self.penalty.get(batch_bucket(rows), 1.0)


@dataclass
class SpeculationBudget:
    """Chooses each step's width; `observe` learns every row's acceptance and the decoder's pooled acceptance."""

    cost: StepCostModel = field(default_factory=StepCostModel)
    token_budget: int | None = None  # most B x T tokens per forward (padding included); None = no cap
    enabled: bool = True  # False: verify every draft as proposed (still capped by token_budget)
    pooled: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    planning_s: float = 0.0  # time spent choosing widths
    payoff: MeasuredPayoff = field(default_factory=MeasuredPayoff)
    check_payoff: bool = True  # False: trust the model alone (tests with a fixed cost function)
    # Exploration: after this many steps in a row that had drafts but verified none, verify one token per row.
    # Without it a batch whose first drafts were rejected never verifies again (its acceptance estimates have no
    # way back up): measured, pld_plus_a verified 14 tokens of a code-edit pass, then none (0.72x ar).
    explore_every: int = 16
    idle_steps: int = 0
    # Resting: after this many refused steps the rows stop proposing until the next exploring step (proposals
    # nobody verifies are pure cost: measured, pld on RAG prompts drafted 20,918 tokens, verified none, 0.91x ar).
    # A rested step counts as a refused one, so exploration keeps its cadence. 0 = never rest.
    rest_after: int = 4

    def drafting_due(self) -> bool:
        """Whether the rows should propose drafts this step (False while speculation rests)."""
        if not self.enabled or not self.rest_after or not self.explore_every or self.idle_steps < self.rest_after:
            return True  # (without exploration a rest would never end)
        if self.explore_every and self.idle_steps + 1 >= self.explore_every:
            return True  # this step explores: it needs drafts
        self.idle_steps += 1
        return False

    def choose_width(self, reaches: list[list[int]], estimates: list[AcceptanceEstimate], context: int = 0) -> int:
        """T for this step (1 = no drafts verified). reaches[r][n - 1] = the deepest path row r's draft cut to n
        tokens can accept (a chain: n; a tree: less than its node count), so len(reaches[r]) is its proposal.
        `context` = the longest live row's cached positions (costs are measured per context bucket)."""
        rows = len(reaches)
        lengths = [len(reach) for reach in reaches]
        longest = max(lengths, default=0)
        if self.token_budget is not None:
            longest = min(longest, max(1, self.token_budget // max(rows, 1)) - 1)
        if longest <= 0:
            return 1
        if not self.enabled:
            return longest + 1
        if self.check_payoff and (self.payoff.probe_due(rows) or not self.cost.knows_plain(rows, context)):
            return 1  # a plain step now and then keeps the measured comparison (and the cost model's unit) current
        started = time.perf_counter()
        prior = self.pooled.rate(prior=0.5)
        rates = [e.rate(prior) for e in estimates]
        # Every width up to the longest draft competes: drafts are cut to the step's width, so a batch of 10-token
        # drafts may pay best at T = 2 (checking only the drafts' own lengths + 1 once left whole batches at T = 1).
        # E(T) is built up width by width: a row whose cut draft reaches one level deeper adds rate^depth (the
        # geometric sum 1 + a + ... + a^depth gains its next term); rows sorted longest draft first stop early.
        order = sorted(range(rows), key=lambda r: -lengths[r])
        depth, power = [0] * rows, [1.0] * rows
        gain = float(rows)
        best, best_value = 1, float(rows)  # T = 1: every row emits one token at cost ratio 1
        for width in range(2, longest + 2):
            drafted = width - 1
            for r in order:
                reach = reaches[r]
                if len(reach) < drafted:
                    break
                if reach[drafted - 1] > depth[r]:
                    depth[r] = reach[drafted - 1]
                    power[r] *= rates[r]
                    gain += power[r]
            ratio = self.cost.ratio(rows, width, context)
            value = gain / (self.payoff.scaled(rows, ratio) if self.check_payoff else ratio)
            if value > best_value:
                best, best_value = width, value
        self.planning_s += time.perf_counter() - started
        self.idle_steps = self.idle_steps + 1 if best == 1 else 0
        if self.explore_every and self.idle_steps >= self.explore_every:
            self.idle_steps = 0
            return 2  # one draft token per row: every drafting row's estimate gets a fresh observation
        return best

    def record_step(self, rows: int, width: int, tokens: int, seconds: float, context: int = 0) -> None:
        """A finished step: its width, the tokens its rows kept and its wall time (forward + verification);
        `context` as for `choose_width` (the longest row's cached positions before the step)."""
        self.cost.observe(rows, width, seconds, context)
        if self.enabled and self.check_payoff:
            self.payoff.record(rows, width, tokens, seconds)

    def observe(self, estimate: AcceptanceEstimate, drafted: int, accepted: int) -> None:
        estimate.update(drafted, accepted)
        self.pooled.update(drafted, accepted)
