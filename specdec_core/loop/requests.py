"""Per-request decoding state and the rules every step applies to it: emit tokens, stop (EOS, stop string,
length, context limit), how many draft tokens may still be verified. The loop itself is `batch_decode.py`; one
request alone is `Engine.generate_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..defaults import DEFAULT_MAX_NEW_TOKENS
from ..errors import BadRequestError
from ..model.model_runner import ModelRunner
from .metrics import RequestMetrics
from .sampling import PositionDraws, SamplingParams

FINISH_STOP = "stop"  # EOS or a stop string
FINISH_LENGTH = "length"  # max_new_tokens or the model's context limit


@dataclass(frozen=True)
class DecodeParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class SequenceState:
    tokens: list[int]
    prompt_len: int
    generator: torch.Generator  # a draft model's draws, and verification against its probabilities (sampling.py)
    metrics: RequestMetrics
    finish_reason: str | None = None
    stop_text: str | None = None  # output text cut at a stop string
    draw_seed: int = 0  # the target's draws of this row: by position (sampling.PositionDraws)

    @classmethod
    def new(cls, prompt_ids: Sequence[int], generator: torch.Generator, draw_seed: int) -> "SequenceState":
        return cls(tokens=list(prompt_ids), prompt_len=len(prompt_ids), generator=generator,
                   metrics=RequestMetrics(prompt_tokens=len(prompt_ids)), draw_seed=draw_seed)

    def target_draws(self) -> PositionDraws:
        """The target's draws for the tokens that follow: the next is at position len(tokens)."""
        return PositionDraws(self.draw_seed, len(self.tokens))

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


def draft_budget(target: ModelRunner, state: SequenceState, params: DecodeParams) -> int:
    """Most draft tokens this step may verify without passing max_new_tokens or the context limit."""
    room_new = params.max_new_tokens - state.num_generated - 1
    room_context = target.max_positions - len(state.tokens) - 1
    return max(0, min(room_new, room_context))


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


def final_text(target: ModelRunner, state: SequenceState) -> str:
    if state.stop_text is not None:
        return state.stop_text
    return target.tokenizer.decode(state.generated, skip_special_tokens=True)

