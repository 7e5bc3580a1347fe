"""SPECTRA-CORE (paper Algorithm 1): guesses from a forward and a backward n-gram dictionary, fed by a pool of W
token rows that the target extends in the same forward that verifies the guesses.

One step, for one row of the batch:
  1. Guesses: every continuation the forward dictionary holds for the pending token (newest first), then one guess
     built by the backward dictionary (token by token, longest context of N-1..1 tokens first); capped at G.
  2. Draft = a tree: the guesses merged into a trie, then the W pool rows, each a chain c_0..c_{N-2} from the
     pending token (so a pool token sees the prefix, the pending token and the row's earlier tokens, as §3.1's mask;
     guesses and pool rows never see each other). Draft.probes names each pool row's last node: the loop hands
     this drafter the target's logits there (DRAFT_LOGITS), from the same forward that verifies the tree.
  3. Verification is the engine's tree verification: greedy = the longest guess prefix equal to the target's
     argmax + one target token (Algorithm 3); sampling = multi-draft speculative sampling of one-hot branches
     (Algorithm 4). A pool branch may be accepted too (any branch equal to the target's choices is exact).
  4. Pool update (the τ rule): with probability 1 - τ (r > τ, r ~ U[0, 1], as Algorithm 1 and §3.1 read literally;
     Appendix B's "threshold ... to determine when to force" allows the reading "with probability τ", which
     `force_unseen_probability` can select) the row's new last token is the target's most likely token that is not
     yet a key of the forward dictionary (so later steps find guesses for it); otherwise the plain argmax.
  5. The completed row c_0..c_{N-1} feeds the dictionaries (sub-n-grams: forward c_j -> c_{j+1:}, backward
     c_{0:j} -> c_{j+1}), then the row shifts left by one.

Choices where the paper is silent (each said here so it can be revisited): the pool starts from random tokens of
the prompt (as Lookahead); a row feeds the dictionaries only once all its tokens were predicted by the target
(earlier its n-grams hold the random seed tokens); a forward key keeps at most W continuations (newest kept,
a repeat moves to the front; Appendix B's "W = 15 maintained per key"); dictionaries are per request. Pool rows
whose last node a speculation budget cut from the step are not extended that step (a budget that refuses every
draft therefore starves the pool); rows take turns when not all fit. Probe
branches add nothing to the budget's expected gain or acceptance estimates (batch_decode._reach).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ..loop.draft_tree import build_trie_with_origins
from ..method_options import DEFAULTS
from .base import DRAFT_LOGITS, Draft, Drafter, RequestContext, empty_draft
from .retrieval import RETRIEVAL_SOURCE

SPECTRA_SOURCE = "spectra"


class NgramDictionaries:
    """SPECTRA's forward (token -> continuations, newest first, at most `per_key`) and backward (context of 1..N-1
    tokens -> next token, the latest write wins) dictionaries."""

    def __init__(self, n: int, per_key: int):
        self.n, self.per_key = n, per_key
        self.forward: dict[int, list[tuple[int, ...]]] = {}
        self.backward: dict[tuple[int, ...], int] = {}

    def insert(self, gram: Sequence[int]) -> None:
        """Algorithm 1 l.36-40 for one completed row c_0..c_{N-1}."""
        gram = tuple(gram)
        for j in range(len(gram) - 1):
            continuation = gram[j + 1:]
            held = self.forward.setdefault(gram[j], [])
            if continuation in held:
                held.remove(continuation)
            held.insert(0, continuation)
            del held[self.per_key:]
            self.backward[gram[: j + 1]] = gram[j + 1]

    def backward_guess(self, tokens: Sequence[int], length: int) -> list[int]:
        """Algorithm 1 l.8-14: extend by the backward dictionary, the longest known context first."""
        guess: list[int] = []
        for _ in range(length):
            context = list(tokens[-(self.n - 1):]) + guess
            for k in range(min(self.n - 1, len(context)), 0, -1):
                found = self.backward.get(tuple(context[-k:]))
                if found is not None:
                    guess.append(found)
                    break
            else:
                break  # no context of any length is known: the guess ends here
        return guess


class SpectraDrafter(Drafter):
    reads = frozenset({DRAFT_LOGITS})

    def __init__(self, n: int = DEFAULTS.spectra_n, pool_rows: int = DEFAULTS.spectra_pool,
                 max_guesses: int = DEFAULTS.spectra_guesses, tau: float = DEFAULTS.spectra_tau,
                 force_unseen_probability: float | None = None, seed: int = 0, retriever=None):
        if n < 2:
            raise ValueError("SPECTRA needs n-grams of at least 2 tokens")
        self.n, self.pool_rows, self.max_guesses = n, pool_rows, max_guesses
        # P(force an unseen token): the literal reading 1 - τ unless given.
        self.force_unseen = 1.0 - tau if force_unseen_probability is None else force_unseen_probability
        self.random = random.Random(seed)
        self.dictionaries = NgramDictionaries(n, per_key=pool_rows)
        # The candidate pool C (not Drafter.pool, the draft-model pool): W rows of N - 1 tokens c_0 .. c_{N-2}
        self.candidates: list[list[int]] = []
        self.predicted: list[int] = []  # per row: how many of its tokens the target predicted (warm-up)
        self.probe_row: dict[int, int] = {}  # the last draft's probed node -> its pool row
        self.retriever = retriever  # retrieval.RetrievalTreeDrafter: external guesses fill up to G (§3.2)
        self.first_row = 0  # the pool row probed first next step

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        if self.retriever is not None:
            self.retriever.start(tokens, request)
        seed_tokens = list(tokens[: request.prompt_len]) or list(tokens)
        self.candidates = [[self.random.choice(seed_tokens) for _ in range(self.n - 1)] for _ in range(self.pool_rows)]
        self.predicted = [0] * self.pool_rows

    def guesses(self, tokens: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """-> (internal, external) guesses, at most G together: the forward dictionary's continuations of the
        pending token (newest first), the backward guess, then the corpus's (Algorithm 1 l.7-17)."""
        internal = [list(g) for g in self.dictionaries.forward.get(tokens[-1], ())]
        backward = self.dictionaries.backward_guess(tokens, self.n - 1)
        if backward and backward not in internal:
            internal.append(backward)
        internal = internal[: self.max_guesses]
        external = []
        if self.retriever is not None and len(internal) < self.max_guesses:
            external = [g for g in self.retriever.branches(tokens, self.n - 1, self.max_guesses)
                        if g not in internal][: self.max_guesses - len(internal)]
        return internal, external

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        internal, external = self.guesses(tokens)
        nodes, parents, origins = build_trie_with_origins(internal + external)
        sources = [SPECTRA_SOURCE if o < len(internal) else RETRIEVAL_SOURCE for o in origins]
        probes, self.probe_row = [], {}
        # Rows take turns: when not all fit (the guesses and max_tokens leave less room than W rows), the next step
        # starts after the last row probed, so every row keeps advancing.
        for step in range(len(self.candidates)):
            row = (self.first_row + step) % len(self.candidates)
            chain = self.candidates[row]
            if len(nodes) + len(chain) > max_tokens:
                break  # the rows that do not fit wait for a later step
            start = len(nodes)
            nodes.extend(chain)
            parents.extend([-1] + list(range(start, start + len(chain) - 1)))
            sources.extend([SPECTRA_SOURCE] * len(chain))
            probes.append(len(nodes) - 1)
            self.probe_row[len(nodes) - 1] = row
        if self.candidates:
            self.first_row = (self.first_row + len(probes)) % len(self.candidates)
        if not nodes:
            return empty_draft()
        return Draft(tokens=nodes, source=SPECTRA_SOURCE, parents=parents, token_sources=sources,
                     probes=probes).truncated(max_tokens)  # guesses alone may exceed the limit

    def finish(self) -> None:
        if self.retriever is not None:
            self.retriever.finish()

    def observe_logits(self, probes: list[int], logits: torch.Tensor) -> None:
        """logits [len(probes), vocab]: the target's next-token logits after each probed pool row that the step
        verified (a budget may have cut some)."""
        seen = None  # the forward dictionary's keys, gathered when a row first needs them
        for node, scores in zip(probes, logits):
            row = self.probe_row.get(node)
            if row is None:
                continue
            if self.dictionaries.forward and self.random.random() < self.force_unseen:
                if seen is None:
                    seen = torch.tensor(list(self.dictionaries.forward), dtype=torch.long)
                scores = scores.clone()
                scores[seen[seen < scores.shape[-1]]] = float("-inf")
            gram = self.candidates[row] + [int(torch.argmax(scores))]
            self.predicted[row] += 1
            if self.predicted[row] >= self.n:  # every token of the gram came from the target
                self.dictionaries.insert(gram)
            self.candidates[row] = gram[1:]
