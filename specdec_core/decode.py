"""The one decode loop: draft -> verify with ONE target forward -> accept -> crop the KV cache -> observe -> stop?

State lives in a per-row `SequenceState` (tokens, cache, generator, counters) so that a batched loop can later step
several rows of different lengths and draft lengths; this version steps one row at a time.

Invariant between steps: `state.tokens` = prompt + emitted tokens, and the target cache holds every token but the
last one (the "pending" token, fed at the start of the next step together with the draft).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .drafters.base import Draft, Drafter, RequestContext
from .errors import BadRequestError
from .metrics import TARGET_SOURCE, RequestMetrics
from .model_runner import ModelRunner
from .sampling import SamplingParams, make_generator, select_token
from .verification import verify

FINISH_STOP = "stop"  # EOS or a stop string
FINISH_LENGTH = "length"  # max_new_tokens or the model's context limit


@dataclass(frozen=True)
class DecodeParams:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class SequenceState:
    tokens: list[int]
    prompt_len: int
    cache: object
    generator: torch.Generator
    metrics: RequestMetrics
    finish_reason: str | None = None
    stop_text: str | None = None  # output text cut at a stop string

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        # Checked for every emitted token: a length, not the copy `generated` makes.
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class DecodeResult:
    token_ids: list[int]  # generated ids, ending with the EOS token when decoding stopped on it
    text: str
    finish_reason: str
    metrics: RequestMetrics


def check_prompt(target: ModelRunner, prompt_ids: Sequence[int]) -> None:
    if len(prompt_ids) == 0:
        raise BadRequestError("empty prompt: nothing to decode")
    if len(prompt_ids) >= target.max_positions:
        raise BadRequestError(
            f"prompt has {len(prompt_ids)} tokens, the model's context limit is {target.max_positions}: "
            "shorten the prompt"
        )


def prefill(target: ModelRunner, prompt_ids: list[int], params: DecodeParams) -> SequenceState:
    """Run the prompt and emit the first token (that is what TTFT measures)."""
    check_prompt(target, prompt_ids)
    state = SequenceState(
        tokens=list(prompt_ids),
        prompt_len=len(prompt_ids),
        cache=target.new_cache(),
        generator=make_generator(params.sampling.seed),
        metrics=RequestMetrics(prompt_tokens=len(prompt_ids)),
    )
    logits = target.forward(state.cache, state.tokens, num_logits=1).logits[0]  # [vocab]
    state.metrics.target_forwards += 1
    emit(target, state, [(select_token(logits, params.sampling, state.generator), TARGET_SOURCE, False)], params)
    return state


def draft_budget(target: ModelRunner, state: SequenceState, params: DecodeParams) -> int:
    """Most draft tokens this step may verify without passing max_new_tokens or the context limit."""
    room_new = params.max_new_tokens - state.num_generated - 1
    room_context = target.max_positions - len(state.tokens) - 1
    return max(0, min(room_new, room_context))


def speculative_step(target: ModelRunner, drafter: Drafter, state: SequenceState, params: DecodeParams) -> None:
    draft = drafter.propose(state.tokens, draft_budget(target, state, params))
    k = len(draft.tokens)
    cached = len(state.tokens) - 1
    # One target forward over [pending] + draft gives k + 1 next-token distributions.
    logits = target.forward(state.cache, [state.tokens[-1], *draft.tokens], num_logits=k + 1).logits  # [k+1, V]
    state.metrics.target_forwards += 1
    result = verify(draft.tokens, logits, params.sampling, state.generator, draft.probs)
    # Keep the pending token and the accepted draft tokens in the cache; the new pending token is not fed yet.
    target.crop(state.cache, cached + 1 + result.num_accepted)
    state.metrics.drafted_tokens += k
    kept = emit(target, state, _sourced(draft, result.num_accepted, result.next_token), params)
    state.metrics.accepted_tokens += min(kept, result.num_accepted)
    drafter.observe(state.tokens, draft, result.num_accepted)


def _sourced(draft: Draft, num_accepted: int, next_token: int) -> list[tuple[int, str, bool]]:
    accepted = [(token, draft.source, draft.from_context) for token in draft.tokens[:num_accepted]]
    return accepted + [(next_token, TARGET_SOURCE, False)]


def emit(target: ModelRunner, state: SequenceState, new: list[tuple[int, str, bool]], params: DecodeParams) -> int:
    """Append (token, source, copied) one by one until a stop condition; returns how many were kept."""
    metrics = state.metrics
    kept = 0
    for token, source, copied in new:
        state.tokens.append(token)
        kept += 1
        metrics.new_tokens += 1
        metrics.accepted_by_source[source] += 1
        metrics.copied_tokens += copied
        if token in target.eos_token_ids:
            state.finish_reason = FINISH_STOP  # the EOS token is kept, as HF generate does; text skips it
            break
        if params.stop_strings and hit_stop_string(target, state, params.stop_strings):
            break  # tokens after the one that completed a stop string are dropped
        if state.num_generated >= params.max_new_tokens or len(state.tokens) >= target.max_positions:
            state.finish_reason = FINISH_LENGTH
            break
    return kept


def hit_stop_string(target: ModelRunner, state: SequenceState, stop_strings: tuple[str, ...]) -> bool:
    """Did the last token complete a stop string? If so, cut the output text before it and finish."""
    # A stop string of n characters spans at most n tokens (+ a few for multi-byte pieces): decode only that tail
    # per token, and the whole text once on a hit.
    window = max(len(s) for s in stop_strings) + 4
    tail = target.tokenizer.decode(state.tokens[max(state.prompt_len, len(state.tokens) - window):],
                                  skip_special_tokens=True)
    if not any(s and s in tail for s in stop_strings):
        return False
    text = target.tokenizer.decode(state.generated, skip_special_tokens=True)
    state.stop_text = text[: min(text.find(s) for s in stop_strings if s and s in text)]
    state.finish_reason = FINISH_STOP
    return True


def decode(
    target: ModelRunner,
    drafter: Drafter,
    prompt_ids: list[int],
    params: DecodeParams,
    context_ids: list[int] | None = None,
) -> DecodeResult:
    started = time.perf_counter()
    state = prefill(target, prompt_ids, params)
    state.metrics.ttft_s = time.perf_counter() - started
    drafter.start(
        state.tokens,
        RequestContext(
            prompt_len=state.prompt_len, context_ids=context_ids, sampling=params.sampling, generator=state.generator
        ),
    )
    while not state.finished:
        speculative_step(target, drafter, state, params)
    state.metrics.wall_s = time.perf_counter() - started
    text = state.stop_text
    if text is None:
        text = target.tokenizer.decode(state.generated, skip_special_tokens=True)
    return DecodeResult(
        token_ids=list(state.generated), text=text, finish_reason=state.finish_reason, metrics=state.metrics
    )
