"""Perplexity of texts under a causal LM, batched for throughput (the corpus refinement job's scoring, SPECTRA §3.2).

ppl(text) = exp(mean over tokens 1..n-1 of -log p(x_i | x_<i)): the text's own tokens, no BOS added (the index
stores exactly these tokens), so the first token is not scored and a one-token text has no perplexity.

A text longer than `window` tokens is scored in windows: each window after the first starts `overlap` tokens before
the first token it scores, so every scored token (past the first window) sees at least `overlap` tokens of context,
and each token is scored exactly once. Windows of all texts in a call are sorted by length and packed into forwards
of at most `tokens_per_forward` padded tokens (right padding, so positions need no shift); the LM head runs only on
the positions that are scored, in chunks, never on padding and never as one [batch, T, vocab] tensor.

Forwards of ~1,024 padded tokens are the default: on a CPU much larger forwards score slower, as the activations of
a large forward fall out of the cache (decisions.md: operators/perplexity.py); a GPU wants far larger forwards
(--tokens-per-forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

HEAD_CHUNK = 2048  # positions per LM-head chunk: [2048, 49152] fp32 logits are 400 MB at most


@dataclass(frozen=True)
class Window:
    text: int  # index of the text in the call
    begin: int  # first token fed to the model
    end: int  # one past the last token fed
    first_scored: int  # first token whose NLL this window adds (> begin)

    @property
    def length(self) -> int:
        return self.end - self.begin


def text_windows(text: int, n_tokens: int, window: int, overlap: int) -> list[Window]:
    """Windows covering tokens 1..n-1 of one text once each; none for a text of fewer than 2 tokens."""
    if window < 2 or not 0 <= overlap <= window - 2:  # each window must score at least one new token
        raise ValueError(f"need window >= 2 and 0 <= overlap <= window - 2 (got window {window}, overlap {overlap})")
    out, scored_up_to = [], 1  # token 0 is never scored
    while scored_up_to < n_tokens:
        begin = max(0, scored_up_to - 1 - overlap) if out else 0
        end = min(n_tokens, begin + window)
        out.append(Window(text, begin, end, scored_up_to))
        scored_up_to = end
    return out


def pack_windows(windows: list[Window], tokens_per_forward: int) -> list[list[Window]]:
    """Longest first, greedily: a forward holds rows while rows x its longest window <= tokens_per_forward (a
    window longer than that goes alone). Sorting by length keeps padding small."""
    ordered = sorted(windows, key=lambda w: (-w.length, w.text, w.begin))
    batches: list[list[Window]] = []
    for window in ordered:
        if batches and (len(batches[-1]) + 1) * batches[-1][0].length <= tokens_per_forward:
            batches[-1].append(window)
        else:
            batches.append([window])
    return batches


@dataclass
class TextScore:
    token_count: int
    scored_tokens: int
    nll_sum: float

    @property
    def ppl(self) -> float | None:
        return float(np.exp(self.nll_sum / self.scored_tokens)) if self.scored_tokens else None


class PerplexityScorer:
    """Scores token lists with a loaded ModelRunner (its base model and LM head, Gemma's soft-capping included)."""

    def __init__(self, runner, window: int = 1024, overlap: int = 128, tokens_per_forward: int = 1024):
        text_windows(0, 0, window, overlap)  # checks the arguments
        self.runner, self.window, self.overlap, self.tokens_per_forward = runner, window, overlap, tokens_per_forward
        self.pad_id = runner.tokenizer.pad_token_id if runner.tokenizer.pad_token_id is not None else 0

    def windows(self, token_lists: list[list[int]]) -> list[Window]:
        return [w for i, ids in enumerate(token_lists) for w in text_windows(i, len(ids), self.window, self.overlap)]

    @torch.inference_mode()
    def score(self, token_lists: list[list[int]]) -> list[TextScore]:
        nll_sums = np.zeros(len(token_lists), dtype=np.float64)
        counts = np.zeros(len(token_lists), dtype=np.int64)
        for batch in pack_windows(self.windows(token_lists), self.tokens_per_forward):
            sums, texts = self._forward(batch, token_lists)
            np.add.at(nll_sums, texts, sums)
            for w in batch:
                counts[w.text] += w.end - w.first_scored
        return [TextScore(len(ids), int(c), float(s)) for ids, c, s in zip(token_lists, counts, nll_sums)]

    def _forward(self, batch: list[Window], token_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """One padded forward -> (NLL sum per window, its text index)."""
        device = self.runner.device
        width = batch[0].length  # longest first
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
        scored = torch.zeros((len(batch), width), dtype=torch.bool)  # [B, T]: hidden at j predicts token j+1
        targets = []
        for row, w in enumerate(batch):
            ids[row, : w.length] = torch.tensor(token_lists[w.text][w.begin:w.end])
            mask[row, : w.length] = 1
            scored[row, w.first_scored - 1 - w.begin: w.length - 1] = True
            targets.append(ids[row, w.first_scored - w.begin: w.length])
        hidden = self.runner.base_model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        picked = hidden[scored.to(device)]  # [N, hidden], row-major: window 0's positions, then window 1's...
        target = torch.cat(targets).to(device)  # [N]
        nll = torch.cat([torch.nn.functional.cross_entropy(self.runner.head_logits(picked[i:i + HEAD_CHUNK]),
                                                           target[i:i + HEAD_CHUNK], reduction="none")
                         for i in range(0, len(target), HEAD_CHUNK)]).double().cpu()  # [N]
        per_window = torch.tensor([w.end - w.first_scored for w in batch])
        sums = torch.zeros(len(batch), dtype=torch.float64).index_add_(
            0, torch.repeat_interleave(torch.arange(len(batch)), per_window), nll)
        return sums.numpy(), np.array([w.text for w in batch])
