"""Per-request speed counters with their definitions (the output contract's, matching vLLM / Spec-Bench / hf-bench).

  target_forwards       prefill + one forward per decode step (each step verifies one draft)
  mean_accepted_length  new_tokens / target_forwards; includes the bonus token, so plain AR = 1.0
  acceptance_rate       accepted_tokens / drafted_tokens (None when nothing was drafted)
  copied_tokens         accepted draft tokens that were copied from the request's own prompt/history
  accepted_by_source    kept tokens by who produced them: each drafter's source name, and "target" for the tokens
                        the target emitted itself (first, recovered and bonus tokens); sums to new_tokens
  ttft_s                prefill + first token
  tpot_s                (wall_s - ttft_s) / (new_tokens - 1)
  tokens_per_s          new_tokens / wall_s
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

TARGET_SOURCE = "target"


@dataclass
class RequestMetrics:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    copied_tokens: int = 0
    accepted_by_source: Counter = field(default_factory=Counter)
    ttft_s: float = 0.0
    wall_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tpot_s(self) -> float | None:
        return (self.wall_s - self.ttft_s) / (self.new_tokens - 1) if self.new_tokens > 1 else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else None

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "copied_tokens": self.copied_tokens,
            "accepted_by_source": dict(self.accepted_by_source),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
        }
