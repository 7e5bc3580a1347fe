"""The one decode loop, batched with continuous batching: admit -> draft -> ONE target forward for all rows ->
verify per row -> commit per row -> retire -> admit ... (batch size 1 is just B = 1, not another code path).

Every live row owns a slot of the engine's `SlotKVCache` and a `SequenceState`. Invariant between steps, per row:
`state.tokens` = prompt + emitted tokens, and the cache row holds every token but the last (the "pending" token,
fed at the start of the next step together with the row's draft).

A step, worked through for 3 rows whose drafters proposed [3, 0, 2] tokens and a budget that allows T = 4:

    input   [3, 4]: row 0 = pending + d0 d1 d2 ; row 1 = pending + pad pad pad ; row 2 = pending + d0 d1 + pad
    logits  rows 0,0,0,0, 1, 2,2,2 at t = 0,1,2,3, 0, 0,1,2  ->  [8, vocab] (never [3, 4, vocab])
    verify  row 0 accepts 1 -> emits d0 + recovered; row 1 emits its one target token; row 2 accepts 2 -> d0 d1 bonus
    commit  cache lengths += 1 + accepted: 2, 1, 3 (rejected positions are dead keys, overwritten next step)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from itertools import accumulate, islice

import numpy as np
import torch

from ..defaults import DEFAULT_BATCH_SIZE
from ..drafters.base import HIDDEN_STATES, Draft, Drafter, DraftPool, RequestContext, empty_draft
from ..model.model_runner import ModelRunner
from ..model.graph_step import Sampling
from ..model.step_batch import StepBatch
from ..model.step_buckets import CALIBRATED_WIDTHS, row_bucket
from .draft_tree import depths, prefix_depths
from .kv_cache import new_slot_cache
from .metrics import TARGET_SOURCE
from .prefill_plan import default_budget, next_forward, worth_reusing
from .prefix_cache import PrefixCache, ScopedPrefixCache
from .requests import (
    DecodeParams,
    DecodeResult,
    SequenceState,
    check_prompt,
    draft_budget,
    emit,
    final_text,
)
from .sampling import SamplingParams, draw_nodes, make_generator, row_seed, select_token
from .speculation_budget import AcceptanceEstimate, SpeculationBudget, batch_bucket, context_bucket, step_worth
from .step_inputs import chain_visibility, step_inputs
from .target_signals import PendingAttention, Signals, deliver_attention, hand_over, wanted
from .verification import ConditionalRule, VerifyResult, accept_greedy_nodes, check_rule, verify_rows

DEFAULT_CACHE_BUDGET_BYTES = 4 << 30  # KV cache of one decoder; a 24 GiB machine may run two actors and two models
# Most steps a free slot waits, with requests waiting, for a live row that will surely retire by then (its tokens left),
# so both slots fill in one prefill forward: each forward reads every weight once, and rows that speculate retire one
# at a time (decisions.md: specdec_core/loop/batch_decode.py).
ADMIT_WAIT_STEPS = 2

NO_DRAFT = empty_draft()  # the draft of every row whose drafter never proposes (nothing changes an empty draft)


@dataclass
class DecodeRequest:
    key: object  # the caller's handle, returned with the result
    prompt_ids: list[int]
    params: DecodeParams
    drafter: Drafter
    context_ids: list[int] | None = None
    turns_after: int = 0  # a conversation's turns still to come once this one ends (each up to max_new_tokens)
    rule: ConditionalRule | None = None  # a lossy method's verification rule (its spec's, methods.py); None: exact


@dataclass
class Row:
    request: DecodeRequest
    state: SequenceState
    admitted_at: float
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    draft: Draft | None = None
    limit: int = 0  # draft tokens the step verifies (its plan's, or the pinned limit)
    error: str | None = None
    attention: PendingAttention | None = None  # what its drafter asked for at the last commit, until it proposes
    # Whether its tokens count in the budget's view of the step: False for a row that can no longer set the pass's
    # length while nothing waits for a slot (SpeculationBudget.critical).
    counts: bool = True
    # Its drafter's while_verifying bookkeeping was put off while drafting rests; done before it next proposes.
    behind: bool = False


@dataclass
class BatchStats:
    """What one decoder pass did, for the runs row: occupancy = mean live rows per step."""

    steps: int = 0
    row_steps: int = 0
    drafted_tokens: int = 0  # proposed by the drafters
    verified_tokens: int = 0  # of those, verified after the budget cut them to the step's width
    accepted_tokens: int = 0
    new_tokens: int = 0
    peak_cache_bytes: int = 0
    peak_rows: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0  # of wall_s, spent in prompts' prefill forwards (on a CPU, most of a long-prompt job)
    # of wall_s, capturing graph-ready steps (graph_step.py: a GPU's graph per step shape), timing their widths and
    # the prefill's attentions (ModelRunner._pick_prefill_attention)
    capture_s: float = 0.0
    # of wall_s, inside graph-ready steps less their captures: each step's inputs copied in, its replay and its one
    # copy back. On a GPU the host waits there for the device; the rest of a decode step is the loop's host work.
    graph_s: float = 0.0
    prompt_tokens: int = 0  # of the admitted rows
    prefix_hit_tokens: int = 0  # of those, copied from the prefix cache instead of computed

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def mean_occupancy(self) -> float | None:
        return self.row_steps / self.steps if self.steps else None


class BatchDecoder:
    """Decodes requests with continuous batching on one target; each request brings its own drafter."""

    def __init__(self, target: ModelRunner, max_batch: int = DEFAULT_BATCH_SIZE, budget: SpeculationBudget | None = None,
                 cache_budget_bytes: int = DEFAULT_CACHE_BUDGET_BYTES, max_draft: int = 64,
                 row_timeout_s: float | None = None, prefix_cache: PrefixCache | ScopedPrefixCache | None = None,
                 prefill_tokens: int | None = None, draft_pool=None, job_memory=None):
        if max_batch < 1:
            raise ValueError(f"batch size must be >= 1, got {max_batch}")
        if row_timeout_s is not None and not row_timeout_s > 0:
            raise ValueError(f"row timeout must be > 0 seconds, got {row_timeout_s}")
        self.target = target
        self.max_batch = max_batch
        self.budget = budget or SpeculationBudget.for_target(target)
        self.cache_budget_bytes = cache_budget_bytes
        self.cache = new_slot_cache(target)
        self.rows: list[Row] = []  # rows[i] lives in cache row i
        self.waiting: deque[DecodeRequest] = deque()
        self.finished: deque[tuple[DecodeRequest, DecodeResult | str]] = deque()
        self.stats = BatchStats()
        # When a forward (or a step around it) last finished, and the slowest so far: a job's hang watchdog reads
        # them (operators/hang_watchdog.py), as a forward stuck in native code cannot be interrupted from Python.
        self.last_progress = time.monotonic()
        self.slowest_forward_s = 0.0
        self.draft_pool = draft_pool  # the engine's draft-model pool for this decoder's drafters, if it has a draft model
        self.job_memory = job_memory  # the engine's job memory for this decoder's method (job_memory.py), if it keeps one
        self.max_draft = max_draft
        self._paths: list[tuple[int, list[int], list[int]]] = []  # (row, from, to): this step's accepted tree paths
        # Room past a row's last position for one step's padded draft tokens (rows pad up to the step's width).
        self.step_slack = 1 + max_draft
        self._calibrated: set[tuple[int, int]] = set()  # (batch bucket, context bucket)s whose widths were timed
        # A row decoding longer than this since its admission retires with an error and frees its slot (checked
        # between steps: one forward is never interrupted).
        self.row_timeout_s = row_timeout_s
        # The engine's store as this decoder's method sees it (PrefixCache.scope; a job's actor keeps one for all
        # its calls); a decoder on its own keeps one for its run. PrefixCache(budget_bytes=0) turns it off.
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        if prefill_tokens is None:
            prefill_tokens = default_budget(target.device)
        if prefill_tokens < 1:
            raise ValueError(f"the prefill token budget must be >= 1, got {prefill_tokens}")
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (prefill_plan.py)
        self.admit_wait = ADMIT_WAIT_STEPS  # 0 = admit as soon as a slot frees
        self._admit_waited = 0  # steps the free slots have waited so far

    # ----------------------------------------------------------------------------------------------- public
    def submit(self, request: DecodeRequest) -> None:
        self.waiting.append(request)

    def run(self, requests: Iterable[DecodeRequest] = ()) -> Iterator[tuple[DecodeRequest, DecodeResult | str]]:
        """Decode until nothing waits or runs; yields (request, result or error message) as rows finish. Requests
        submitted while iterating (a conversation's next turn) join the batch."""
        started = time.perf_counter()
        for request in requests:
            self.submit(request)
        # Shortest prompts first: rows in flight then have similar lengths, and every row attends over the longest
        # live row's keys (padded slots), so mixed lengths waste attention. HF users get the same from sorting
        # their batches by length. Later turns, submitted while running, queue behind.
        self.waiting = deque(sorted(self.waiting, key=lambda request: len(request.prompt_ids)))
        while self.waiting or self.rows or self.finished:
            self.admit()
            if self.rows:
                self.step()
            while self.finished:
                self.stats.wall_s = time.perf_counter() - started
                yield self.finished.popleft()
        self.stats.wall_s = time.perf_counter() - started

    # ----------------------------------------------------------------------------------------------- admission
    def _capacity_for(self, request: DecodeRequest) -> int:
        longest = min(len(request.prompt_ids) + request.params.max_new_tokens, self.target.max_positions)
        return longest + self.step_slack

    def admit(self) -> None:
        """Move waiting requests into free slots and prefill them together (prefill_plan.py).

        The requests admitted together are chosen first and the cache is fitted once for all of them: fitting per
        admission reallocated (and copied) every live row's keys once per admission while a batch filled up
        (decisions.md: specdec_core/loop/batch_decode.py)."""
        if self._waits_for_retiring_rows():
            return
        admitted: list[DecodeRequest] = []
        capacity = max((self._capacity_for(r.request) for r in self.rows), default=0)
        while self.waiting and len(self.rows) + len(admitted) < self.max_batch:
            request = self.waiting[0]
            refusal = self._refusal(request)
            if refusal is not None:
                self.waiting.popleft()
                self.finished.append((request, refusal))
                continue
            wanted = max(capacity, self._capacity_for(request))
            needed = self.cache.bytes_for(self._slots_for(len(self.rows) + len(admitted) + 1), wanted)
            if needed > self.cache_budget_bytes:
                if self.rows or admitted:
                    break  # wait for rows to retire
                self.waiting.popleft()
                self.finished.append((request, (
                    f"KVCacheBudgetError: this request needs {needed / 2**30:.2f} GiB of KV cache, over the decoder's "
                    f"budget of {self.cache_budget_bytes / 2**30:.2f} GiB: shorten the prompt or max_new_tokens")))
                continue
            self.waiting.popleft()
            admitted.append(request)
            capacity = wanted
        if admitted:
            slots = self._slots_for(len(self.rows) + len(admitted))
            self.cache.fit(slots, self._reserved(capacity, slots), shrink=not self.target.captures_steps)
            self._prefill(admitted)
        self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, self.cache.nbytes)

    def _refusal(self, request: DecodeRequest) -> str | None:
        """Why admission refuses `request` (its error row's value: an empty or overlong prompt, a rule it cannot
        decode under), or None."""
        try:
            check_prompt(self.target, request.prompt_ids)
            check_rule(request.rule, request.params.sampling)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _waits_for_retiring_rows(self) -> bool:
        """Whether this step's admission waits for a live row that retires within the steps left of `admit_wait`
        (each step emits at least one token a row), to fill its slot in the same prefill forward. Only while
        requests wait for more than the free slots, so the wait fills a slot that would otherwise join later."""
        free = self.max_batch - len(self.rows)
        if not free or not self.rows or len(self.waiting) <= free:
            self._admit_waited = 0
            return False
        left = self.admit_wait - self._admit_waited
        if left > 0 and any(_tokens_left(row) <= left for row in self.rows):
            self._admit_waited += 1
            return True
        self._admit_waited = 0
        return False

    def _reserved(self, capacity: int, slots: int) -> int:
        """The capacity to fit the cache to: enough for the live and admitted rows (`capacity`) and, where the cache
        budget allows, for every waiting request too (else for the next max_batch of them), which join as these rows
        retire. Rows that retire one at a time (speculation) are replaced one at a time, and each longer prompt from
        the sorted queue otherwise reallocated and copied the whole cache (decisions.md:
        specdec_core/loop/batch_decode.py). The pass's peak is the same: those requests grow the cache to it when
        they join; a request that admission will refuse (`_refusal`) reserves nothing. The queue is read only where
        the fit would change the cache (more slots, more positions, or rows that need under half of it). Not where
        steps are captured: their graphs are kept per capacity."""
        if self.target.captures_steps:
            return capacity
        held = self.cache.capacity
        if slots <= self.cache.slots and capacity <= held < 2 * capacity:
            return held  # the cache holds these rows and is not twice what they need: it stays as it is
        for ahead in (len(self.waiting), self.max_batch):
            longest = max((self._capacity_for(r) for r in islice(self.waiting, ahead) if self._refusal(r) is None),
                          default=0)
            if longest <= capacity:
                break
            if self.cache.bytes_for(slots, longest) <= self.cache_budget_bytes:
                return longest
        return capacity

    def _slots_for(self, rows: int) -> int:
        """Cache slots for `rows` live rows: as many, or with captured steps the row bucket that holds them (within
        the batch size), so the cache reallocates, and its graphs are captured again, only when the bucket grows."""
        return row_bucket(rows, self.max_batch) if self.target.captures_steps else rows

    def _prefill(self, requests: list[DecodeRequest]) -> None:
        """New rows for `requests`, their prompts fed in shared, chunked forwards after what the prefix cache
        holds; each row's first token comes from the forward that feeds its last prompt token."""
        started = time.perf_counter()
        pending = []
        for request in requests:
            seed = request.params.sampling.seed
            row = Row(request, SequenceState.new(request.prompt_ids, make_generator(seed), row_seed(seed)), started)
            self.cache.add_row()
            self.rows.append(row)
            self.stats.prompt_tokens += len(request.prompt_ids)
            try:
                request.drafter.prepare(self.target)
                pending.append(_Prefill(row, 0))
            except Exception as exc:  # a bad row errors alone; the batch goes on
                row.error = f"{type(exc).__name__}: {exc}"
        while pending:
            group, chunks = self._plan_prefill(pending)
            try:
                self._prefill_forward(group, chunks)
            except Exception as exc:
                if len(group) == 1:
                    group[0].row.error = f"{type(exc).__name__}: {exc}"
                else:
                    self._prefill_alone(group)
            pending = [p for p in pending if p.row.error is None and p.done < len(p.row.request.prompt_ids)]
        live = {id(row): index for index, row in enumerate(self.rows)}
        self._retire([live[id(r)] for r in self.rows[len(self.rows) - len(requests):]
                      if r.error or r.state.finished])

    def _plan_prefill(self, pending: list["_Prefill"]) -> tuple[list["_Prefill"], list[int]]:
        """The rows of the next prefill forward and their chunks. A row looks up the prefix cache when it is first
        planned, not at admission: by then the rows fed before it have stored their prompts' blocks, so the second
        of 16 rows that share a chat template already reuses it."""
        while True:
            chunks = next_forward([len(p.row.request.prompt_ids) - p.done for p in pending], [p.done for p in pending],
                                  self.cache.capacity, self.prefill_tokens)
            fresh = [p for p in pending[:len(chunks)] if not p.looked_up]
            if not fresh:
                return pending[:len(chunks)], chunks
            live = {id(row): index for index, row in enumerate(self.rows)}
            for entry in fresh:
                entry.done = self._reuse_prefix(live[id(entry.row)], entry)
                entry.looked_up = True

    def _prefill_alone(self, group: list["_Prefill"]) -> None:
        """After a shared prefill forward failed: each of its rows fed by itself, so only a failing row fails."""
        for entry in group:
            prompt_len = len(entry.row.request.prompt_ids)
            while entry.row.error is None and entry.done < prompt_len:
                try:
                    self._prefill_forward([entry], [min(prompt_len - entry.done, self.prefill_tokens)])
                except Exception as exc:
                    entry.row.error = f"{type(exc).__name__}: {exc}"

    def _reuse_prefix(self, index: int, entry: "_Prefill") -> int:
        """Copy the cached blocks the prompt starts with into its row; -> how many prompt positions they cover.
        A drafter that reads the target's hidden states at every prompt position (PLD+ (h)) takes only blocks that
        hold its layer's states too (stored by `_start_row`), and is handed those states first."""
        request = entry.row.request
        layer = request.drafter.hidden_layer if HIDDEN_STATES in request.drafter.reads else None
        blocks = self.prefix_cache.lookup(request.prompt_ids, hidden_layer=layer)
        if not worth_reusing(len(blocks) * self.prefix_cache.block, len(request.prompt_ids), self.prefill_tokens,
                             masked=not self.target.unmasked_prefill, rows_apart=self.target.prefill_rows_apart):
            blocks = []
        reused = self.prefix_cache.copy_into(self.cache, index, blocks)
        if layer is not None and blocks:
            entry.hidden.append(torch.cat([block.hidden[layer] for block in blocks]))  # [reused, hidden]
        self.stats.prefix_hit_tokens += reused
        return reused

    def _prefill_forward(self, group: list["_Prefill"], chunks: list[int]) -> None:
        """One forward feeding chunks[i] more prompt tokens of group[i]; rows whose prompt ends here get their first
        token and start decoding."""
        live = {id(row): index for index, row in enumerate(self.rows)}
        indices = [live[id(p.row)] for p in group]
        width = max(chunks)
        done = torch.tensor([entry.done for entry in group])  # [b]
        input_ids = torch.tensor([entry.row.request.prompt_ids[entry.done: entry.done + chunk] + [0] * (width - chunk)
                                  for entry, chunk in zip(group, chunks)], dtype=torch.long)  # [b, T]
        positions = done[:, None] + torch.arange(width)  # [b, T]
        visible = torch.from_numpy(chain_visibility(np.array(chunks), width)[1])  # [b, T, T]
        ending = [(b, chunk - 1) for b, (entry, chunk) in enumerate(zip(group, chunks))
                  if entry.done + chunk == len(entry.row.request.prompt_ids)]  # (batch row, its last node)
        signals = wanted([p.row.request.drafter for p in group])
        forward_started, picking = time.perf_counter(), self.target.attention_pick_s
        batch = StepBatch(input_ids, positions, visible, torch.tensor(ending, dtype=torch.long).view(-1, 2),
                          rows=indices, prefill=True, **signals.forward_kwargs())
        logits = self.target.forward_slots(self.cache, batch)  # [len(ending), vocab]
        picked = self.target.attention_pick_s - picking  # timing the attentions (a GPU's first masked prefill)
        self.stats.capture_s += picked
        self.stats.prefill_s += time.perf_counter() - forward_started - picked
        self._progress(time.perf_counter() - forward_started - picked)  # (the hang watchdog's slowest forward)
        for entry, chunk, index in zip(group, chunks, indices):
            entry.done += chunk
            self.cache.set_length(index, entry.done)
            self.prefix_cache.store(self.cache, index, entry.row.request.prompt_ids)  # for the rows fed later
        finishing = {b: logits[i] for i, (b, _) in enumerate(ending)}
        for b, (entry, chunk, index) in enumerate(zip(group, chunks, indices)):
            drafter = entry.row.request.drafter
            try:
                if b not in finishing:
                    if HIDDEN_STATES in drafter.reads:  # handed over with the last chunk, after the drafter starts
                        entry.hidden.append(signals.hidden[drafter.hidden_layer][b, :chunk].clone())
                    continue
                self._start_row(entry, finishing[b], signals, b, index, chunk)
            except Exception as exc:
                entry.row.error = f"{type(exc).__name__}: {exc}"

    def _start_row(self, entry: "_Prefill", logits: torch.Tensor, signals: Signals, batch_row: int, index: int,
                   chunk: int) -> None:
        row, request = entry.row, entry.row.request
        state = row.state
        state.metrics.target_forwards += 1  # the prefill counts once, however many forwards fed it
        first = select_token(logits, request.params.sampling, state.target_draws())
        emit(self.target, state, [(first, TARGET_SOURCE, False)], request.params)
        state.metrics.ttft_s = time.perf_counter() - row.admitted_at
        request.drafter.start(state.tokens, RequestContext(
            prompt_len=state.prompt_len, context_ids=request.context_ids, sampling=request.params.sampling,
            generator=state.generator, eos_token_ids=self.target.eos_token_ids, job_memory=self.job_memory,
            tokens_left=max(0, min(_tokens_left(row), self.target.max_positions - len(state.tokens)))))
        if HIDDEN_STATES in request.drafter.reads:  # the whole prompt's states, for later rows' prefix hits
            layer = request.drafter.hidden_layer
            self.prefix_cache.store_hidden(request.prompt_ids, layer,
                                           torch.cat(entry.hidden + [signals.hidden[layer][batch_row, :chunk]]))
        if entry.hidden:
            request.drafter.observe_hidden(torch.cat(entry.hidden))  # the earlier chunks' positions, in order
        row.attention = hand_over(signals, request.drafter, self.cache, index, batch_row,
                                  list(range(chunk)))

    # ----------------------------------------------------------------------------------------------- one step
    def step(self) -> None:
        """One decode step: every row proposes, the budget plans how much of each draft to verify, the draft models
        draft what was planned, then one target forward verifies every row and commits what it accepted."""
        self._retire_overdue()
        if not self.rows:
            return
        self._time_widths()
        step_started, tokens_before = time.perf_counter(), self.stats.new_tokens
        drafting = self.budget.drafting_due()
        pools = self._propose(drafting)
        context = max(self.cache.lengths, default=0)
        if self.rows:  # proposals may have retired failing rows
            self._plan(pools, drafting, context)
            self._rank_planned()
        self._flush(pools)  # (a pool that fails retires its rows)
        if not self.rows:
            return
        started, captured = time.perf_counter(), self.stats.capture_s
        count, width, real, worth = self._verify(self.rows)
        self._progress(time.perf_counter() - step_started)
        finished = time.perf_counter() - (self.stats.capture_s - captured)  # a capture is no step's cost
        drafting_s = started - step_started - self.budget.pricing.prefill_s
        self.budget.record_step(count, width, worth, finished - started, context, real, drafting_s=drafting_s)
        self.budget.pricing.record_step(self.stats.new_tokens - tokens_before, finished - step_started)

    def _time_widths(self) -> None:
        """Where the target's steps are captured (a GPU), the first time the rows meet a (batch bucket, context
        bucket) with drafts to verify: time a step at each of CALIBRATED_WIDTHS and hand the budget their cost over
        a plain step's. On a GPU a verify step costs little more than a plain one, and the budget's priors (a CPU's)
        would price its first wide steps far too high. The seconds count with the captures', apart from decoding."""
        graph = self.target.graph_step()
        if graph is None or not graph.calibrates or not self.budget.enabled:
            return
        rows, context = len(self.rows), max(self.cache.lengths[:len(self.rows)], default=0)
        key = (batch_bucket(rows), context_bucket(context))
        if key in self._calibrated:  # (checked first: the checks below cost every step of every row)
            return
        if not any(r.request.drafter.proposes for r in self.rows):
            return
        signals = wanted([r.request.drafter for r in self.rows])
        if not _graph_ready(self.rows, signals):
            return  # these steps run the eager forward: the graph's cost is not theirs
        self._calibrated.add(key)
        widest = 1 + min(self.max_draft, self.budget.most_nodes(rows))
        started = time.perf_counter()
        seconds = graph.time_widths(self.cache, rows, [w for w in CALIBRATED_WIDTHS if w <= widest],
                                    accept_greedy_nodes, _sampling(self.rows))
        self.stats.capture_s += time.perf_counter() - started
        self.last_progress = time.monotonic()  # (the hang watchdog: timing may have compiled and captured)
        if seconds.get(1):
            self.budget.cost.calibrate(rows, context, {w: s / seconds[1] for w, s in seconds.items()})

    def _progress(self, seconds: float) -> None:
        self.last_progress = time.monotonic()
        self.slowest_forward_s = max(self.slowest_forward_s, seconds)

    def _propose(self, drafting: bool) -> dict[int, DraftPool]:
        """Each row's proposal, or only the pinned rows' while drafting rests. A seeded sampling row's drafts never
        go through the budget, whose choices follow the clock: it always drafts and verifies what its drafter
        proposed, and reproduces whatever shares its batch, run after run (the batch pays for its width). Its draws
        come by position (sampling.PositionDraws), or from its generator where a draft model drafts, whose draws
        depend on how many tokens it verifies; in bf16 a token's logits also change with its step's width.
        -> the draft-model pools asked."""
        for row in self.rows:
            row.draft = empty_draft() if row.request.drafter.proposes else NO_DRAFT
        proposing = [r for r in self.rows if r.request.drafter.proposes]
        return self._collect(proposing if drafting else [r for r in proposing if _pinned(r)])

    def _plan(self, pools: dict[int, DraftPool], drafting: bool, context: int) -> None:
        """Sets each row's `limit`: how many of its draft tokens this step verifies.

        The plan comes before the draft models run: a token a draft model drafts costs one of its forwards, so a
        pooled row drafts no further than the plan will verify (planned on the length it asked for; the numbers
        behind it: docs/decisions.md, "The loop and the budget"). While drafting rests only pinned rows drafted:
        the budget is not asked (its rest and exploration counters count that step already)."""
        rows = self.rows
        if not any(r.request.drafter.proposes for r in rows):  # plain decoding: nothing to plan
            for row in rows:
                row.limit = 0
            return
        pinned = [_pinned(r) for r in rows]
        pinned_limit = self._pinned_draft_limit()  # never depends on timing: the token budget over a full batch
        reaches = [_reach(r.draft, pools)[:pinned_limit] if fixed else _reach(r.draft, pools)
                   for r, fixed in zip(rows, pinned)]
        critical = None if self.waiting else self.budget.critical([_tokens_left(r) for r in rows])
        for row, counts in zip(rows, critical or [True] * len(rows)):
            row.counts = counts
        confidences = [r.draft.confidence for r in rows]
        limits = (self.budget.plan(reaches, [r.acceptance for r in rows], context, critical, confidences)
                  if drafting else [0] * len(rows))
        for row, fixed, limit, reach in zip(rows, pinned, limits, reaches):
            if limit and not fixed and row.request.drafter.prices_its_length:
                # Its own priced stop ends the draft (DraftPricing), on the drafter's probability of each token;
                # the plan's geometric model only knows the row's past acceptance (docs/decisions.md).
                limit = min(len(reach), self.budget.most_nodes(len(rows)))
            row.limit = pinned_limit if fixed else limit
            if not fixed and row.request.drafter.pool is not None:
                row.request.drafter.pool.cap(row.draft, limit)
        self.budget.pricing.verify_s = self.budget.cost.token_seconds(len(rows), context)

    def _verify(self, rows: list[Row]) -> tuple[int, int, int, float]:
        """Cut each draft to its limit, run ONE target forward over every row's pending token and draft, verify and
        commit. -> (rows, width, tokens computed) of the forward, for the budget's cost model, and what the step's
        tokens were worth (`_commit`)."""
        for row in rows:
            self.stats.drafted_tokens += len(row.draft)
            row.draft = row.draft.truncated(row.limit)
        width = 1 + max(len(r.draft) for r in rows)
        real = sum(1 + len(r.draft) for r in rows)
        step_ids, positions, visible, logit_index = self._step_inputs(rows, width)
        # A draft token the target does not have (the union baseline's OUTSIDE id) is always rejected, so what its
        # node reads is never used: it is fed as id 0 instead of indexing past the embedding.
        input_ids = step_ids.masked_fill(step_ids >= self.target.vocab_size, 0)
        signals = wanted([r.request.drafter for r in rows])
        batch = StepBatch(input_ids, positions, visible, logit_index, **signals.forward_kwargs())
        count = len(rows)
        graph = self.target.graph_step()  # (None on a CPU by default)
        launched = None
        if graph is not None and _graph_ready(rows, signals):
            captured, started = graph.capture_s, time.perf_counter()
            launched = graph.launch(self.cache, batch, step_ids, accept_greedy_nodes, _sampling(rows))
            self.stats.capture_s += graph.capture_s - captured
            self.stats.graph_s += time.perf_counter() - started - (graph.capture_s - captured)
        self._while_verifying(rows)  # (an eager forward blocks: there it runs first, for the same drafts)
        if launched is not None:  # verified on the device: [accepted, last node, next token] a row
            started = time.perf_counter()
            on_host = launched.result()
            self.stats.graph_s += time.perf_counter() - started
            results = [_node_result(row.draft, *found) for row, found in zip(rows, on_host)]
            return count, width, real, self._commit(rows, None, signals, step_ids, results)
        logits = self.target.forward_slots(self.cache, batch)  # [N, vocab]
        return count, width, real, self._commit(rows, logits, signals, step_ids)

    def _while_verifying(self, rows: list[Row]) -> None:
        """The drafters' bookkeeping that no proposal of this step needs (Drafter.works_while_verifying), while the
        device verifies the step. Where the next step rests from drafting, a row that only proposes when drafting
        puts it off until it next proposes (`_catch_up`): one call then covers every step since, and the steps
        that propose nothing pay nothing for it. A failure is the row's error (the step still commits its tokens)."""
        resting = self.budget.rests_next()
        for row in rows:
            if row.request.drafter.works_while_verifying and row.error is None:
                if resting and not _pinned(row):
                    row.behind = True
                else:
                    self._bookkeep(row)

    def _catch_up(self, rows: list[Row]) -> None:
        """The bookkeeping `rows` put off while drafting rested, before any of them proposes (a job memory's
        rows draft from each other's outputs)."""
        for row in rows:
            if row.behind and row.error is None:
                self._bookkeep(row)

    @staticmethod
    def _bookkeep(row: Row) -> None:
        row.behind = False
        try:
            row.request.drafter.while_verifying(row.state.tokens)
        except Exception as exc:
            row.error = f"{type(exc).__name__}: {exc}"

    def _pinned_draft_limit(self) -> int:
        """Most draft tokens a seeded sampling row verifies: --token-budget split over a full batch, if set."""
        budget = self.budget.token_budget
        return self.max_draft if budget is None else max(0, budget // self.max_batch - 1)

    def _retire_overdue(self) -> None:
        if self.row_timeout_s is None:
            return
        now = time.perf_counter()
        overdue = [i for i, row in enumerate(self.rows) if now - row.admitted_at > self.row_timeout_s]
        for index in overdue:
            row = self.rows[index]
            row.error = (f"RowTimeoutError: the row decoded for {now - row.admitted_at:.1f} s, over the row timeout "
                         f"of {self.row_timeout_s:g} s, after {len(row.state.generated)} new tokens")
        if overdue:
            self._retire(overdue)

    def _collect(self, rows: list[Row]) -> dict[int, DraftPool]:
        """Each of `rows`' proposals (all live rows, or the pinned ones while drafting rests). Drafters that share
        a pool (a draft model) only ask here; `_flush` drafts for them together. -> the pools asked."""
        pools = {id(r.request.drafter.pool): r.request.drafter.pool for r in rows if r.request.drafter.pool}
        self._catch_up(rows)
        failed = [row for row in rows if row.error is not None]
        failed += self._deliver_attention([row for row in rows if row.error is None])
        with ExitStack() as collecting:
            for pool in pools.values():
                collecting.enter_context(pool.collecting_proposals())
            failed += [row for row in rows if row.error is None and not self._propose_row(row, outline=True)]
        self._retire_rows(failed)
        return pools

    def _propose_row(self, row: Row, outline: bool = False) -> bool:
        """row.draft = its drafter's proposal (`outline`: its outline, where it ranks after the plan). -> False where
        the drafter failed (the failure is the row's error)."""
        drafter = row.request.drafter
        try:
            limit = min(self.max_draft, draft_budget(self.target, row.state, row.request.params))
            propose = drafter.outline if outline and drafter.ranks_after_plan else drafter.propose
            row.draft = propose(row.state.tokens, limit)
        except Exception as exc:
            row.error = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def _deliver_attention(self, rows: list[Row], after_plan: bool = False) -> list[Row]:
        """The attention weights of `rows` about to propose, as asked at their last commit, in one pass, where the
        drafter will read them (`after_plan`: the rows _rank_planned chose; else those whose drafter takes them
        before proposing). -> the rows that failed (a failure is their error)."""
        if all(row.attention is None for row in rows):  # every method but PLD+ (a)
            return []
        index = {id(row): i for i, row in enumerate(self.rows)}  # rows move when others leave (remove_row)
        asks, asking = [], []
        for row in rows:
            if row.request.drafter.ranks_after_plan and not after_plan:
                continue  # asked for after the plan, if it verifies some of the row's draft (_rank_planned)
            ask, row.attention = row.attention, None
            if ask is not None and row.request.drafter.wants_attention(row.state.tokens):
                asks.append((row.request.drafter, ask, index[id(row)]))
                asking.append(row)
        if not asks:
            return []
        try:
            deliver_attention(self.target, self.cache, asks)
        except Exception as exc:
            for row in asking:
                row.error = f"{type(exc).__name__}: {exc}"
            return asking
        return []

    def _rank_planned(self) -> None:
        """Rows whose drafter ranks after the plan (Drafter.ranks_after_plan) and that the plan lets verify some of
        their outline: their attention weights where they read them (one pass), then their proposal. A row the plan
        verifies nothing of never pays for either."""
        ranking = [r for r in self.rows if r.request.drafter.ranks_after_plan]
        for row in ranking:
            if not row.limit:
                row.attention = None
        planned = [r for r in ranking if r.limit]
        if not planned:
            return
        failed = self._deliver_attention(planned, after_plan=True)
        self._retire_rows(failed + [row for row in planned if row.error is None and not self._propose_row(row)])

    def _flush(self, pools: dict[int, DraftPool]) -> None:
        """Fill the pooled drafts asked for in `_collect`; a pool that fails fails its rows, the others go on."""
        failed = []
        for key, pool in pools.items():
            try:
                pool.flush()
            except Exception as exc:
                for row in self.rows:
                    if id(row.request.drafter.pool) == key and row.error is None:
                        row.error = f"{type(exc).__name__}: {exc}"
                        failed.append(row)
        self._retire_rows(failed)

    def _retire_rows(self, rows: list[Row]) -> None:
        live = {id(row): index for index, row in enumerate(self.rows)}
        self._retire([live[id(row)] for row in rows])

    def _step_inputs(self, rows: list[Row], width: int):
        """-> step_ids [B, T], positions [B, T], visible [B, T, T], logit_index [N, 2] (N = sum of 1 + k_r): each
        row's pending token and draft as step_inputs.py lays them out."""
        return step_inputs(self.cache.lengths, [row.state.tokens[-1] for row in rows], [row.draft for row in rows],
                           width)

    def _commit(self, rows: list[Row], logits: torch.Tensor | None, signals: Signals | None = None,
                step_ids: torch.Tensor | None = None, results: list[VerifyResult] | None = None) -> float:
        """Verify (unless the step did: `results`, and no logits) and commit every row. -> what the step's tokens
        were worth to the pass (`step_worth`: only the rows that count, Row.counts, where nothing waits)."""
        if results is None:
            # sampling rows draw by position, unless verified against a draft's probabilities (the generator)
            sources = [r.state.target_draws() if not r.request.params.sampling.greedy and r.draft.probs is None
                       else r.state.generator for r in rows]
            results = verify_rows([r.draft for r in rows], logits, [r.request.params.sampling for r in rows],
                                  sources, step_ids, [r.request.rule for r in rows])
        starts = list(accumulate((1 + len(r.draft.tokens) for r in rows), initial=0))  # row -> its first logit
        handing_over = signals is not None and bool(signals.hidden or signals.heads)
        self.stats.steps += 1
        self.stats.row_steps += len(rows)
        self.stats.peak_rows = max(self.stats.peak_rows, len(rows))
        done, step_kept, step_accepted, kept_by_row = [], 0, 0, []
        for index, (row, result) in enumerate(zip(rows, results)):
            kept = 0
            try:
                if not row.draft.tokens and not handing_over:  # the loop's commonest case
                    kept, accepted = self._emit_plain(index, row, result), 0
                else:
                    kept, accepted = self._emit_verified(index, row, result, signals if handing_over else None)
                step_kept, step_accepted = step_kept + kept, step_accepted + accepted
                self._learn(row, result, logits, starts[index])
            except Exception as exc:
                row.error = f"{type(exc).__name__}: {exc}"
            kept_by_row.append(kept)
            if row.error or row.state.finished:
                done.append(index)
        self._move_paths()  # before a retiring row's slot is filled by another
        self.budget.emitted(step_kept, step_accepted)
        worth = step_worth(kept_by_row, [row.counts for row in rows])
        self._retire(done)
        return worth

    def _move_paths(self) -> None:
        """The accepted tree paths committed so far this step, moved into chain order in one cache copy."""
        if self._paths:
            paths, self._paths = self._paths, []
            self.cache.move(paths)

    def _emit_plain(self, index: int, row: Row, result: VerifyResult) -> int:
        """A row that verified nothing: its one target token -> tokens kept."""
        self.cache.set_length(index, self.cache.lengths[index] + 1)
        row.state.metrics.target_forwards += 1
        kept = emit(self.target, row.state, [(result.next_token, TARGET_SOURCE, False)], row.request.params)
        self.stats.new_tokens += kept
        return kept

    def _emit_verified(self, index: int, row: Row, result: VerifyResult, signals: Signals | None) -> tuple[int, int]:
        """A row that verified a draft (or hands the target's signals to its drafter): move an accepted tree path
        into chain order, hand the signals over, emit -> (tokens kept, draft tokens accepted)."""
        draft, state = row.draft, row.state
        drafted = len(draft.tokens)
        length = self.cache.lengths[index]
        if draft.parents is not None and result.path:
            # The accepted path's keys sit at their node offsets; move them to where a chain puts them (with the
            # step's other rows' paths, in `_commit`, unless the signals handed over below read the cache first).
            nodes = [i + 1 for i in result.path]
            self._paths.append((index, [length + n for n in nodes], [length + d for d in range(1, len(nodes) + 1)]))
        self.cache.set_length(index, length + 1 + result.num_accepted)
        if signals is not None:
            self._move_paths()
            # The nodes now in the cache: the pending token (node 0) and the accepted path.
            nodes = [0] + [i + 1 for i in result.accepted_indices()]
            row.attention = hand_over(signals, row.request.drafter, self.cache, index, index, nodes)
        state.metrics.target_forwards += 1
        state.metrics.drafted_tokens += drafted
        kept = emit(self.target, state, _sourced(draft, result) if drafted
                    else [(result.next_token, TARGET_SOURCE, False)], row.request.params)
        accepted = min(kept, result.num_accepted)
        state.metrics.accepted_tokens += accepted
        self.stats.verified_tokens += drafted
        self.stats.accepted_tokens += accepted
        self.stats.new_tokens += kept
        return kept, accepted

    def _learn(self, row: Row, result: VerifyResult, logits: torch.Tensor, start: int) -> None:
        """The budget's acceptance estimate and the drafter learn from the step. logits [N, vocab]: the step's, the
        row's from `start` (its pending token)."""
        draft = row.draft
        if draft.tokens:
            # Acceptance is judged on what the draft offered for acceptance (probe branches left out).
            offered = _reach(draft)[-1] if draft.probes else draft.max_depth
            if offered:  # (an empty draft teaches the acceptance estimates nothing)
                confidence = None if draft.probes else draft.confidence
                self.budget.observe(row.acceptance, offered, min(result.num_accepted, offered), confidence)
        if draft.probes:  # logits after the probed nodes (node i + 1 holds draft token i)
            row.request.drafter.observe_logits(list(draft.probes), logits[[start + 1 + p for p in draft.probes]])
        if row.request.drafter.proposes:
            row.request.drafter.observe(row.state.tokens, draft, result.num_accepted)

    # ----------------------------------------------------------------------------------------------- retire
    def _retire(self, indices: list[int]) -> None:
        """Finish rows and free their slots (highest index first: a removal moves the last row into the hole)."""
        now = time.perf_counter()
        for index in sorted(indices, reverse=True):
            row = self.rows[index]
            if row.error:
                self.finished.append((row.request, row.error))
            else:
                row.state.metrics.wall_s = now - row.admitted_at
                self.finished.append((row.request, DecodeResult(
                    token_ids=list(row.state.generated), text=final_text(self.target, row.state),
                    finish_reason=row.state.finish_reason, metrics=row.state.metrics)))
            try:
                row.request.drafter.finish()
            except Exception:  # freeing a drafter's slot must not stop the batch
                pass
            self.cache.remove_row(index)
            last = self.rows.pop()
            if index < len(self.rows):
                self.rows[index] = last


@dataclass
class _Prefill:
    """A row whose prompt is being fed: `done` of its positions are cached (the prefix cache's included)."""

    row: Row
    done: int
    looked_up: bool = False  # in the prefix cache (_plan_prefill)
    hidden: list[torch.Tensor] = field(default_factory=list)  # [chunk, hidden] per earlier chunk (PLD+ (h) rows)


def _graph_ready(rows: list[Row], signals: Signals) -> bool:
    """Whether a step needs nothing of the target but each node's argmax or draw (what the graph-ready step verifies
    on the device): greedy rows, and sampling rows whose drafts carry no probabilities, under the exact rule, no
    signals read, no probed nodes."""
    return not signals.hidden and not signals.heads and all(
        r.request.rule is None and (r.draft is None or not r.draft.probes)
        and (r.request.params.sampling.greedy or _drawn_on_device(r.draft)) for r in rows)


def _drawn_on_device(draft: Draft | None) -> bool:
    """Whether the graph-ready step draws for a sampling row: where its draft is one-hot (drawn by position:
    sampling.PositionDraws). No draft (a step's width timing, before the first proposals): as one-hot."""
    return draft is None or draft.probs is None


def _sampling(rows: list[Row]) -> Sampling | None:
    """The rows' sampling parameters and draw seeds where some row samples, for the graph-ready step; else None."""
    params = [r.request.params.sampling for r in rows]
    if all(p.greedy for p in params):
        return None
    return Sampling([p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
                    [r.state.draw_seed for r in rows], draw_nodes)


def _node_result(draft: Draft, accepted: int, last: int, token: int) -> VerifyResult:
    """The device's verdict on a row (accepted draft tokens, the last accepted node, the token after it) as
    verify_rows gives it: a tree's accepted path walked back from its last node."""
    if draft.parents is None:
        return VerifyResult(accepted, token)
    path = []
    while last > 0:
        path.append(last - 1)
        last = draft.parents[last - 1] + 1
    return VerifyResult(accepted, token, tuple(reversed(path)))


def _tokens_left(row: Row) -> int:
    """The most tokens this row and its conversation's later turns may still emit."""
    new_tokens = row.request.params.max_new_tokens
    return new_tokens - row.state.num_generated + row.request.turns_after * new_tokens


def _pinned(row: Row) -> bool:
    """A seeded sampling row: its draft is verified as proposed (see BatchDecoder.step)."""
    sampling = row.request.params.sampling
    return not sampling.greedy and sampling.seed is not None


def _reach(draft: Draft, pools: dict[int, DraftPool] | None = None) -> list[int]:
    """[n - 1] -> how deep the draft cut to n tokens can accept (a chain: n; a tree: its deepest of n nodes). Probe
    branches (Draft.probes: verified to learn from, as SPECTRA's pool rows) add no reach: the budget does not expect
    them to be accepted. A draft a pool has yet to fill is planned as the chain it asked for."""
    for pool in (pools or {}).values():
        asked = pool.requested(draft)
        if asked is not None:
            return list(range(1, asked + 1))
    if draft.probes:
        learning = draft.probe_nodes()
        node_depths = depths(draft.parents) if draft.parents is not None else list(range(1, len(draft) + 1))
        deepest, reach = 0, []
        for index, depth in enumerate(node_depths):
            if index not in learning:
                deepest = max(deepest, depth)
            reach.append(deepest)
        return reach
    return prefix_depths(draft.parents) if draft.parents is not None else list(range(1, len(draft) + 1))


def _sourced(draft: Draft, result: VerifyResult) -> list[tuple[int, str, bool]]:
    accepted = [(draft.tokens[i], draft.source_of(i), draft.from_context) for i in result.accepted_indices()]
    return accepted + [(result.next_token, TARGET_SOURCE, False)]
