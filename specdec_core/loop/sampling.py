"""Per-request sampling parameters, the logits -> probabilities transform shared by target and drafters, and the
draws.

A draw is an inverse CDF: the first token whose cumulative probability passes a uniform number u. Where u comes from:
- the target's tokens of a row whose drafts carry no probabilities (`ar`, copying and lookup drafts; chains and
  trees): u is a hash of the row's seed and the token's position (PositionDraws). A token's u then depends on
  nothing else, so where its probabilities do not change with the step (fp32, or bf16 with --deterministic) a
  seeded row samples the same tokens alone, inside any batch, at any draft width and as `ar` does; and the device
  computes the same u inside a captured step (graph_step.py) as the host does here;
- everything else (a draft model's own tokens, and verification against its probabilities, which takes a uniform
  for the acceptance test besides the draw): the request's torch.Generator, on the host.
Either way only u is drawn on the host: the probabilities stay on their device.
"""

from __future__ import annotations

import secrets
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
    # a float32 tensor, not a Python number: a GPU may multiply by a scalar's reciprocal instead of dividing, and a
    # captured step divides by its rows' temperatures (draw_nodes): both divide, to the same bits
    logits = logits.float() / torch.tensor(params.temperature, dtype=torch.float32, device=logits.device)
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


MASK32 = 0xFFFFFFFF
UNIFORM_BITS = 24  # of a hash, as the uniform number: a float32's mantissa holds them exactly


def _times(x, factor: int):
    """(x * factor) mod 2^32 for x in [0, 2^32), an int or an int64 tensor, without passing 2^63 (a tensor's int64
    product would overflow): the low and high 16 bits multiplied apart."""
    return ((x & 0xFFFF) * factor + (((x >> 16) * factor) & 0xFFFF) * 65536) & MASK32


def hash32(x):
    """A 32-bit integer hash (Wellons' lowbias32), on an int or elementwise on an int64 tensor of values in
    [0, 2^32): the same bits on every device."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_at(seed, position):
    """The uniform number in [0, 1) of the token at `position` of a row with `seed` (ints, or int64 tensors that
    broadcast: then a float32 tensor). Exactly representable, so host and device agree to the bit."""
    h = hash32((hash32(seed) + _times(position & MASK32, 0x9E3779B9)) & MASK32)
    if isinstance(h, torch.Tensor):
        return (h >> (32 - UNIFORM_BITS)).float() * 2.0 ** -UNIFORM_BITS
    return (h >> (32 - UNIFORM_BITS)) * 2.0 ** -UNIFORM_BITS


def row_seed(seed: int | None) -> int:
    """A row's 32-bit draw seed: from the request's seed (each 32-bit part, how many there are and the sign), else
    at random (the OS's: a program that seeds Python's `random` does not make unseeded rows repeat)."""
    if seed is None:
        return secrets.randbits(32)
    magnitude, parts, mixed = abs(int(seed)), 0, 0x5EED5EED  # (not 0: hash32(0) is 0, a zero part would vanish)
    while True:
        mixed = hash32(mixed ^ (magnitude & MASK32))
        magnitude, parts = magnitude >> 32, parts + 1
        if not magnitude:
            return hash32(mixed ^ (parts << 1 | (int(seed) < 0)))


class PositionDraws:
    """The target's draws for one row's step, from the token at `position` on: each call of `uniform` gives the next
    position's number (a step emits its tokens in position order, one draw each)."""

    def __init__(self, seed: int, position: int):
        self.seed, self.position = seed, position

    def uniform(self) -> float:
        self.position += 1
        return uniform_at(self.seed, self.position - 1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [..., vocab] (need not sum to 1), uniforms [...] in [0, 1) -> [...] int64: the first token whose
    cumulative probability passes u x the total. A token of probability 0 is never drawn."""
    cumulative = probs.float().cumsum(-1)  # [..., vocab]
    wanted = (uniforms.to(cumulative.device) * cumulative[..., -1])[..., None]  # [..., 1]
    token = torch.searchsorted(cumulative, wanted, right=True)[..., 0].clamp(max=probs.shape[-1] - 1)
    # a parallel scan (a GPU's) may step by an ulp across a run of zeros: never draw a token of probability 0
    return torch.where(probs.gather(-1, token[..., None])[..., 0] > 0, token, probs.argmax(-1))


def next_uniform(source: torch.Generator | PositionDraws) -> float:
    """The next uniform number in [0, 1) of a row's draws (see the module's docstring)."""
    return source.uniform() if isinstance(source, PositionDraws) else float(torch.rand(1, generator=source))


def sample(probs: torch.Tensor, source: torch.Generator | PositionDraws) -> int:
    """Draw one token id from a [vocab] distribution, with the next uniform of `source`."""
    return int(inverse_cdf(probs, torch.tensor(next_uniform(source), dtype=torch.float32)))


def select_token(logits: torch.Tensor, params: SamplingParams, source: torch.Generator | PositionDraws) -> int:
    """The target's next token from [vocab] logits: argmax when greedy, else a draw."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    return sample(logits_to_probs(logits, params), source)


def draw_nodes(logits: torch.Tensor, argmax: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, filtered: bool) -> torch.Tensor:
    """A graph-ready step's draws (graph_step.py), in tensor operations of fixed shapes.
    logits [B, T, vocab], argmax [B, T]; each row's temperature [B] float32 (0: greedy), top_k [B] int64 (0: off),
    top_p [B] float32 (1: off) and draw seed [B] int64; positions [B, T]; filtered: whether some row has top-k or
    top-p (they sort every node's logits; else they are skipped)
    -> [B, T] the token each node's row emits after it: its argmax if greedy, else its draw from its distribution
    (logits_to_probs's, row by row) with the uniform number of the position after the node (what the host draws
    there). With these in place of argmaxes, greedy node verification is one-hot speculative sampling: a node is
    accepted when its token is what its parent's distribution drew (verification.verify_tree_sampling)."""
    scale = torch.where(temperature > 0, temperature, 1.0)[:, None, None]  # [B, 1, 1] float32, as logits_to_probs
    scaled = logits.float() / scale  # [B, T, vocab]
    if filtered:
        scaled = _filtered(scaled, top_k, top_p)
    drawn = inverse_cdf(scaled.softmax(-1), uniform_at(seeds[:, None], positions + 1))  # [B, T]
    return torch.where(temperature[:, None] > 0, drawn, argmax)


def _filtered(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits_to_probs's top-k, then top-p, over [B, T, vocab] scaled logits with each row's top_k [B] (0: off) and
    top_p [B] (1: off) -> the logits, the tokens they drop at -inf."""
    vocab = scaled.shape[-1]
    ordered, order = scaled.sort(dim=-1, descending=True)  # [B, T, vocab]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [B]
    kth = ordered.gather(-1, (k - 1)[:, None, None].expand(*ordered.shape[:2], 1))  # [B, T, 1]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    # the kept logits in the order the host's sort gives them: the same values first, -inf after
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    drop = (probs.cumsum(-1) - probs >= top_p[:, None, None]) & (top_p < 1)[:, None, None]  # [B, T, vocab], sorted
    return scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
