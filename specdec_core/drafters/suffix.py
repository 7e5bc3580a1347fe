"""SuffixDecoding (Oliaro et al., 2024): draft trees from two suffix trees, the request's own (prompt + output) and
the job memory's (earlier and concurrent rows' outputs, job_memory.py); each step the tree expected to give more
accepted tokens is drafted and the loop verifies it as a tree (lossless).

As the paper: the frequency-ranked tree of the longest-matching suffix's continuations, at most factor x the match
length nodes, branches below min_prob cut (suffix_tree.py). Where it differs: suffix tries of bounded depth (the
match and the draft both fit in MEMORY_DEPTH tokens); the two trees' drafts are compared, not merged; a step's
tokens join the row's own tree while the device verifies the next step, so a draft misses what those newest tokens
would add to the own tree's counts (the paper indexes them before drafting).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..method_options import DEFAULTS
from .base import Draft, Drafter, RequestContext, empty_draft
from .job_memory import MEMORY_DEPTH, JobMemory, MemorySequence
from .suffix_tree import Cursor, SuffixTree

SIZED_OUTPUT_TOKENS = 512  # output a row's own tree has room for from its start (a longer one grows it)
SUFFIX_SOURCE = "suffix"  # drafted from the request's own tree
MEMORY_SOURCE = "memory"  # drafted from the job memory's


class SuffixDrafter(Drafter):

    works_while_verifying = True  # the own tree's and the job memory's appends (`while_verifying`)

    def __init__(self, factor: float = DEFAULTS.suffix_spec_factor, min_prob: float = DEFAULTS.suffix_min_prob,
                 depth: int = MEMORY_DEPTH):
        self.factor, self.min_prob, self.depth = factor, min_prob, depth
        self.own: SuffixTree | None = None  # built in start(), per request
        self.own_cursor: Cursor | None = None  # the suffixes of the row's first `indexed` tokens in its own tree
        self.memory: JobMemory | None = None
        self.memory_cursor: Cursor | None = None  # those of them that the memory's tree held when they were matched
        self.output: MemorySequence | None = None  # the row's output, as the memory holds it
        self.indexed = 0  # tokens of the row in its own tree and matched by its memory cursor
        self.remembered = 0  # tokens of the row handed to the job memory so far
        self.prompt_len = 0
        self.latest: Sequence[int] = ()  # the row's tokens as last committed (`finish` hands their end to memory)

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        # Sized once for what the row may add: growing copies the tables, a few times a row. Capped, so a row that
        # may write thousands of tokens and stops early does not hold tables for them.
        self.own = SuffixTree.for_tokens(len(tokens) + min(request.tokens_left, SIZED_OUTPUT_TOKENS), self.depth)
        self.own_cursor = self.own.cursor()
        self.prompt_len = request.prompt_len
        self.memory = request.job_memory
        self.remembered = 0
        self.latest = tokens
        if self.memory is not None:
            self.memory_cursor = self.memory.tree.cursor(tokens[max(0, len(tokens) - self.depth):])
            self.output = self.memory.begin()
        self._remember(tokens)
        self.own.extend(self.own_cursor, tokens)  # (the memory cursor matched the prompt's end already)
        self.indexed = len(tokens)

    def _remember(self, tokens: Sequence[int]) -> None:
        """The output so far (what follows the prompt) into the job memory: other rows draft from it."""
        if self.memory is not None and len(tokens) > self.remembered:
            self.memory.append(self.output, tokens[max(self.remembered, self.prompt_len):])
        self.remembered = len(tokens)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        # The better of the two trees' drafts, from the row's tokens: its cursors matched those up to the last step,
        # and the tokens since are looked up from the suffixes the search reaches (`_draft`). The memory is searched
        # only where one of its suffixes could beat the own draft's score. One compiled call.
        memory = self.memory
        best, from_memory = self.own.best_draft(
            self.own_cursor, tokens[self.indexed:], (max_tokens, self.factor, self.min_prob),
            memory.tree if memory is not None else None, self.memory_cursor)
        if not best.tokens:
            return empty_draft()
        source = MEMORY_SOURCE if from_memory else SUFFIX_SOURCE
        return Draft(tokens=best.tokens, source=source, parents=best.parents, from_context=source == SUFFIX_SOURCE,
                     confidence=best.probs)

    def observe(self, tokens: Sequence[int], draft: Draft, num_accepted: int) -> None:
        self.latest = tokens

    def while_verifying(self, tokens: Sequence[int]) -> None:
        """The tokens committed since the last step into the row's own tree and the job memory, while the device
        verifies: drafts see them a step later than they would at the commit, and no step waits for the appends."""
        new = tokens[self.indexed:]
        self.own.extend(self.own_cursor, new)
        if self.memory is not None:  # (matched before the row's own new tokens join the memory)
            self.memory.tree.advance(self.memory_cursor, new)
        self.indexed = len(tokens)
        self._remember(tokens)

    def finish(self) -> None:
        if self.memory is not None and self.output is not None:
            self._remember(self.latest)
            self.memory.finish(self.output)
            self.output = None
