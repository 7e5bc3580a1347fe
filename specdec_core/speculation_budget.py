"""The speculation budget: how many tokens each row may verify this step, from each row's acceptance and the
measured cost of a `[B, T]` forward, so that speculation shrinks to plain batched decoding where drafts don't pay.

The batched forward is padded: every row computes T = 1 + the longest draft tokens, so the choice is one step width
T for the batch (rows draft min(own proposal, T - 1)). For each candidate T the expected tokens this step are

    E(T) = sum over rows r of  1 + a_r + a_r^2 + ... + a_r^k_r,   k_r = min(len(draft_r), T - 1)

(a_r = row r's per-token acceptance estimate; each accepted draft token is kept only if all before it were: the
usual geometric model, Leviathan et al. §3.1), and the cost is cost(B, T) / cost(B, 1), measured on this machine.
The step takes the T with the most expected tokens per unit of cost; T = 1 (no drafts) always competes, so a batch
whose drafts are not accepted decodes as batched `ar` does. An optional token budget caps B x T.

Costs are measured, not assumed: the first time a (batch size bucket (1, 2, 4, ..., 64), context bucket (256, 1,024,
4,096, ... cached positions)) pair is seen, a few forwards of widths 1..17 run on the live rows (their results are
thrown away: nothing is committed to the cache) and the ratio table is kept for the rest of the run. The context
matters: a long cache makes every step pay for attention whatever its width, so extra tokens cost relatively less.
Measured on the avx512_bf16 CPU (SmolLM2, batch 16): with one table per batch bucket, calibrated on ~1,000-token code
prompts, speculation on ~150-token open questions ran at 0.78-0.89x batched ar (steps 1.5x dearer than the table
said). Measured here: 16 rows, 9 tokens each cost ~1.2x 16 rows of 1 token on an
avx512_bf16 CPU; on a GPU the ratio stays near 1 up to much larger B x T.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

CALIBRATION_WIDTHS = (1, 2, 3, 5, 9, 17)
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
    """cost(B, T) / cost(B, 1) by (batch bucket, context bucket), measured with `measure(width) -> seconds` on the
    live batch."""

    ratios: dict[tuple[int, int], dict[int, float]] = field(default_factory=dict)
    fixed: Callable[[int, int], float] | None = None  # tests: a known cost function instead of measurements

    def ratio(self, rows: int, width: int, measure: Callable[[int], float] | None, context: int = 0) -> float:
        if self.fixed is not None:
            return self.fixed(rows, width) / self.fixed(rows, 1)
        bucket = (batch_bucket(rows), context_bucket(context))
        table = self.ratios.get(bucket) or self._conservative_table(bucket)
        if table is None:
            if measure is None:
                return float(width)  # no way to measure: assume cost grows with width (never over-speculates)
            table = self.ratios[bucket] = self._calibrate(measure)
        return _interpolate(table, width)

    def _conservative_table(self, bucket: tuple[int, int]) -> dict[int, float] | None:
        """A table measured with at least as many rows and at most as long a context, if any: its ratios are at
        least this bucket's, so using it can only under-speculate. Measured on the avx512_bf16 CPU (SmolLM2, width
        17 over width 1): 1.6 / 1.5 / 2.5 / 2.9 / 4.0 at 1 / 2 / 4 / 8 / 16 rows of ~100 cached tokens, 1.2-1.6
        with ~1,000 cached tokens. Without this, a pass calibrated again for every bucket its rows drained through
        (16, 8, 4, 2, 1) and every context bucket they grew into: 65 forwards, 19% of a 32-question pass."""
        rows, context = bucket
        usable = [key for key in self.ratios if key[0] >= rows and key[1] <= context]
        if not usable:
            return None
        return self.ratios[min(usable, key=lambda key: (key[0], -key[1]))]

    @staticmethod
    def _calibrate(measure: Callable[[int], float]) -> dict[int, float]:
        measure(1)  # warm-up (first-call allocations)
        times = {width: min(measure(width) for _ in range(2)) for width in CALIBRATION_WIDTHS}
        base = times[1]
        return {width: max(1.0, t / base) for width, t in times.items()}


def _interpolate(table: dict[int, float], width: int) -> float:
    widths = sorted(table)
    if width <= widths[0]:
        return table[widths[0]]
    for low, high in zip(widths, widths[1:]):
        if width <= high:
            return table[low] + (table[high] - table[low]) * (width - low) / (high - low)
    # Past the largest measured width: extend the last segment's slope.
    low, high = widths[-2], widths[-1]
    return table[high] + (table[high] - table[low]) * (width - high) / (high - low)


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
    planning_s: float = 0.0  # time spent choosing widths, calibration forwards included
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

    def choose_width(self, reaches: list[list[int]], estimates: list[AcceptanceEstimate],
                     measure: Callable[[int], float] | None = None, context: int = 0) -> int:
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
        if self.check_payoff and self.payoff.probe_due(rows):
            return 1  # a plain step now and then keeps the measured comparison current
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
            ratio = self.cost.ratio(rows, width, measure, context)
            value = gain / (self.payoff.scaled(rows, ratio) if self.check_payoff else ratio)
            if value > best_value:
                best, best_value = width, value
        self.planning_s += time.perf_counter() - started
        self.idle_steps = self.idle_steps + 1 if best == 1 else 0
        if self.explore_every and self.idle_steps >= self.explore_every:
            self.idle_steps = 0
            return 2  # one draft token per row: every drafting row's estimate gets a fresh observation
        return best

    def record_step(self, rows: int, width: int, tokens: int, seconds: float) -> None:
        """A finished step: its width, the tokens its rows kept and its wall time (forward + verification)."""
        if self.enabled and self.check_payoff:
            self.payoff.record(rows, width, tokens, seconds)

    def observe(self, estimate: AcceptanceEstimate, drafted: int, accepted: int) -> None:
        estimate.update(drafted, accepted)
        self.pooled.update(drafted, accepted)
