"""How many tokens a drafter proposes next: fixed, or adaptive (grow after full acceptance, shrink after rejections).

Adaptivity only changes how much is drafted, never what is accepted, so it cannot cost losslessness.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLength:
    initial: int
    adaptive: bool = False
    minimum: int = 1
    maximum: int = 64
    # "double": after a fully accepted draft, double (copy drafters: a copied block tends to go on, and a copied
    # token costs nothing to propose). "step": add 2, and take 1 away after a rejection (draft models: each
    # drafted token is a drafter forward, ~0.17-0.24 of a 1.5B target's step on the avx512_bf16 CPU, so a length
    # that overshoots is paid for every step; Hugging Face's assisted generation grows its length the same way).
    growth: str = "double"

    def __post_init__(self):
        if self.initial < 1:
            raise ValueError(f"draft length must be >= 1, got {self.initial}")
        self.minimum = min(self.minimum, self.initial)
        self.maximum = max(self.maximum, self.initial)
        self.current = self.initial

    def update(self, drafted: int, accepted: int, proposed: int | None = None) -> None:
        """`drafted` tokens were verified and `accepted` of them kept; `proposed` (if larger than `drafted`) is
        what the drafter offered before the speculation budget cut the draft."""
        if not self.adaptive or drafted == 0:
            return
        if proposed is not None and proposed > drafted and accepted == drafted:
            return  # the budget ended the draft, not a rejection: nothing was learned about a longer one
        if self.growth == "step":
            self.current = min(self.maximum, self.current + 2) if accepted == drafted else \
                max(self.minimum, self.current - 1)
            return
        if accepted == drafted:
            # A fully accepted draft suggests a long run (a copied block): verifying twice the tokens costs far less
            # than twice as much on this hardware (decisions.md: specdec_core/drafters/draft_length.py), so double.
            self.current = min(self.maximum, self.current * 2)
        else:
            # Halve rather than reset: one mismatch (a renamed identifier) does not end a copied block.
            self.current = max(self.minimum, self.current // 2, accepted + 1)
