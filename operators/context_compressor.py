"""Prompt compression by self-information: keep the context's most surprising words, drop the predictable ones.

CASD (§4) puts a compressed context in the prompt (LLMLingua-2) while its draft pool keeps the full context, so the
copy drafter restores what compression dropped. LLMLingua-2 (a trained token classifier) is not installable here;
this compressor stands in for it, after Selective Context (Li et al., 2023): a causal language model scores every
context token's self-information -log p(x_t | x_<t); words (a run of non-space characters with its leading space)
are ranked by their mean self-information per token and the best are kept, in their original order, until the kept
words hold 1/R of the context's tokens. The result is counted by re-tokenizing it (± 10 % of the target is the
contract; `compress` corrects its word budget when re-tokenizing drifts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

WORD = re.compile(r"\s*\S+|\s+$")


@dataclass
class Compression:
    text: str
    original_tokens: int
    kept_tokens: int

    @property
    def ratio(self) -> float:
        return self.original_tokens / max(1, self.kept_tokens)


class SelfInformationCompressor:
    """Scores tokens with `model` (a Hugging Face causal LM) in windows of `window` tokens, each conditioned on the
    `window // 2` tokens before it, so a long context costs ~2 forwards per window of new tokens."""

    def __init__(self, model, tokenizer, window: int = 1024):
        if window < 2:
            raise ValueError("window must be at least 2 tokens")
        if tokenizer is not None and not getattr(tokenizer, "is_fast", False):
            raise ValueError("context compression maps tokens to words by character offsets: it needs a fast "
                             "(Rust) tokenizer")
        self.model, self.tokenizer, self.window = model, tokenizer, window

    def token_information(self, ids: list[int]) -> np.ndarray:
        """-> [T] self-information in nats; the first token (nothing to predict it from) gets the maximum."""
        import torch

        info = np.zeros(len(ids), dtype=np.float64)
        step = self.window // 2
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            for start in range(0, len(ids), step):
                begin = max(0, start - step)
                chunk = torch.tensor([ids[begin:start + step]], device=device)
                logits = self.model(chunk).logits[0].float()  # [n, V]
                log_probs = torch.log_softmax(logits[:-1], dim=-1)  # predicts chunk[1:]
                targets = chunk[0, 1:]
                surprise = -log_probs.gather(1, targets[:, None])[:, 0].cpu().numpy()  # [n - 1], for begin+1 ..
                lo = max(start, 1)
                info[lo:start + step] = surprise[lo - begin - 1:start + step - begin - 1]
        if len(ids):
            info[0] = info.max() if len(ids) > 1 else 0.0
        return info

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def compress_measured(self, text: str, ratio: float) -> Compression:
        if not ratio >= 1:
            raise ValueError(f"compression ratio must be >= 1, got {ratio}")
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        total = len(ids)
        if ratio == 1 or total < 2:
            return Compression(text, total, total)
        words = [(m.start(), m.end()) for m in WORD.finditer(text)]
        info = self.token_information(ids)
        # Each token to the word holding its first character (tokens that start on a space belong to that word).
        starts = np.array([s for s, _ in words])
        owner = np.clip(np.searchsorted(starts, [s for s, _ in offsets], side="right") - 1, 0, len(words) - 1)
        word_info = np.bincount(owner, weights=info, minlength=len(words))
        word_tokens = np.bincount(owner, minlength=len(words))
        density = np.where(word_tokens > 0, word_info / np.maximum(word_tokens, 1), -np.inf)
        order = np.argsort(-density, kind="stable")  # most informative per token first
        cumulative = np.cumsum(word_tokens[order])
        target = max(1, round(total / ratio))
        budget = target
        best = None
        for _ in range(4):  # re-tokenizing joined words can merge or split tokens: correct the budget
            keep = np.zeros(len(words), dtype=bool)
            keep[order[: int(np.searchsorted(cumulative, budget, side="left")) + 1]] = True
            out = self.join(text, words, keep)
            kept = self.count(out)
            if best is None or abs(kept - target) < abs(best.kept_tokens - target):
                best = Compression(out, total, kept)
            if abs(kept - target) <= 0.05 * target:
                break
            budget = max(1, round(budget * target / max(1, kept)))
        return best

    def compress(self, text: str, ratio: float) -> str:
        return self.compress_measured(text, ratio).text

    @staticmethod
    def join(text: str, words: list[tuple[int, int]], keep: np.ndarray) -> str:
        """The kept words in order; a dropped word that began a new line leaves its line break (the passages keep
        their paragraphs)."""
        parts = []
        for (start, end), kept in zip(words, keep):
            piece = text[start:end]
            if kept:
                parts.append(piece)
            elif "\n" in piece[: len(piece) - len(piece.lstrip())]:
                parts.append("\n")
        out = "".join(parts)
        return out if not out[:1].isspace() or text[:1].isspace() else out.lstrip()
