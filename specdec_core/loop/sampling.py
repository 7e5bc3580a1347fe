"""Per-request sampling parameters and the logits -> probabilities transform shared by target and drafters."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (argmax); otherwise temperature, then top-k, then top-p (nucleus) filtering."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: str = "cpu") -> torch.Generator:
    """One generator per request, so a seeded request reproduces whatever else runs beside it."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] float32 probabilities under temperature / top-k / top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def select_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The target's next token from [vocab] logits: argmax when greedy, else a draw."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    return sample(logits_to_probs(logits, params), generator)
