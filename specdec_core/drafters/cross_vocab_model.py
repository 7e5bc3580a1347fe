"""SLEM (Timor et al., Algorithm 2): a draft model with ANOTHER tokenizer drafts text; the text is re-tokenized into
the target's vocabulary and verified as any one-hot draft (greedy: exact match; sampling: the target's own draws
compared with it), so the output is the target's own, whatever the drafter proposes.

The drafter's rows live in a `CrossVocabPool`: the draft model's slot cache, stepped for all rows in one batched
forward like the same-vocabulary pool (draft_model.py), plus the translation after each flush.

Carrying the accepted tokens back into the drafter's tokens: each step the row's generated target tokens are decoded
to text and that text is re-encoded with the drafter's tokenizer, from the prompt/output boundary on. The pool keeps
the longest prefix its cache shares with the new drafter sequence and feeds only the rest (draft_model.py), so a
re-encoding that changes the last few drafter tokens (a word that grew, a tokenizer that is not injective, §3.2)
costs a short cache cut instead of a wrong context: this is the look-behind alignment, done against the cache.
Re-encoding never inserts BOS or other special tokens (add_special_tokens=False). The prompt is translated once:
its text runs are re-encoded, and its special tokens (chat markers, BOS) become the drafter's where the two
tokenizers share them by role or by text (vocab_mapping.py), and are dropped otherwise.

Token healing (SLEM): the drafter is not fed the last drafter token of the generated text; the first token it
drafts must instead start with that token's bytes. The target splits text where the drafter's tokenizer never
would: Qwen2.5 emits a 4-space indent before a docstring's quotes as "   " + ' ' + quotes, and Gemma 3, fed "\n" +
"   ", reads a 3-space indent and drafts the quotes where its own tokenizer has "\n" + "    " + quotes: such a step had
none of its draft accepted, and the next drafted the same tokens, shifted by one, and had all accepted
(decisions.md: specdec_core/drafters/cross_vocab_model.py). Healing lets the drafter pick "    ".

Draft text -> target tokens: the draft's text is appended to the text of the last few committed target tokens and
encoded together; when that encoding starts with exactly those committed tokens, the rest is the draft (a boundary
the target tokenizer would merge differently is found this way); otherwise the draft text is encoded alone.
"""

from __future__ import annotations

import bisect
import functools
from abc import abstractmethod
from collections.abc import Sequence

import torch

from ..method_options import DEFAULT_DRAFT_TOKENS, DEFAULTS
from ..model.lm_head import SubsetHead
from ..model.model_runner import ModelRunner
from .base import Draft, RequestContext
from .draft_model import DraftModelPool, PooledDrafter, choose_token
from .frequent_tokens import FrequentTokens, RowTokensHead, frequent_tokens
from .vocab_mapping import VocabMapping, load_or_build_first_tokens, special_ids, token_bytes

SOURCE = "draft_model"
LOOK_BEHIND = 8  # committed target tokens re-encoded with the draft text to find the token boundary
REPLACEMENT = "\ufffd"  # a decoded fragment that ends inside a UTF-8 character
PRICED = "priced"  # draft_confidence: stop where one more drafted token costs more than it returns
UNPRICED_FLOOR = 0.4  # the floor until the decoder has priced a drafter forward (HF's assistant threshold)


class CrossVocabPool(DraftModelPool):
    """A draft model whose tokenizer differs from the target's; its drafters' drafts are translated after the
    batched drafting."""

    def __init__(self, runner: ModelRunner, target_tokenizer, mapping: VocabMapping, pricing=None):
        super().__init__(runner, pricing)
        self.target_tokenizer = target_tokenizer
        self.mapping = mapping
        self.target_specials = special_ids(target_tokenizer)
        self._extending: dict[int, torch.Tensor | None] = {}  # token -> the tokens extending it (tokens_extending)

    @property
    def first_tokens(self) -> torch.Tensor:
        """[|D|] the first target token of each draft token's text (SLRS), -1 where none; built once per pair."""
        derived = self.mapping.derived
        if "first_tokens" not in derived:  # (reading the cached file still hashes both tokenizers: slow)
            derived["first_tokens"] = torch.as_tensor(load_or_build_first_tokens(
                self.runner.tokenizer, self.target_tokenizer, self.mapping, self.runner.vocab_size,
                len(self.mapping.target_to_draft)))
        return derived["first_tokens"]

    @property
    def shared_head(self) -> SubsetHead:
        """The drafter's LM head over the tokens the target shares (by bytes, vocab_mapping.py); built once."""
        derived = self.mapping.derived
        if "shared_head" not in derived:
            shared, _ = self.mapping.shared_pairs  # draft ids [S]
            derived["shared_head"] = SubsetHead(self.runner, shared[shared < self.runner.vocab_size])
        return derived["shared_head"]

    def tokens_extending(self, token: int) -> torch.Tensor | None:
        """[n] the drafter's tokens whose bytes start with `token`'s (itself included); None for a token with no
        bytes of its own (a special token). Cached per token."""
        cache = self._extending
        if token not in cache:
            table, keys, ids = _token_table(self.runner)
            prefix = table[token] if token < len(table) else None
            cache[token] = None
            if prefix:
                start, end = bisect.bisect_left(keys, prefix), bisect.bisect_left(keys, _successor(prefix))
                cache[token] = torch.tensor(ids[start:end]) if end > start else None
        return cache[token]

    def is_indent(self, token: int) -> bool:
        """Whether a drafter token is spaces or tabs only: where tokenizers split text differently (an indent is
        one token for Gemma 3, "   " + a space-led word for Qwen2.5) and token healing pays for its extra drafter
        forward. Healing every boundary re-drafted the same token on most steps: one more drafter forward (~0.24
        of a target step for Gemma 3) for the few boundaries it changed."""
        table = _token_table(self.runner)[0]
        text = table[token] if token < len(table) else None
        return bool(text) and not text.strip(b" \t")

    @property
    def frequent(self) -> FrequentTokens:
        """The drafter's frequent tokens and their head (frequent_tokens.py); built once per draft model."""
        return frequent_tokens(self.runner)

    def head_for(self, pending) -> SubsetHead | RowTokensHead | None:
        """The head every row drafting now declares enough (`CrossVocabDrafter.head_tokens`), else the whole one."""
        kinds = {p.drafter.head_tokens for p in pending}
        if kinds == {"shared"}:
            return self.shared_head
        if kinds == {"frequent"}:
            return self.frequent.head_for_rows({self.owners.index(p.drafter): p.drafter.own_tokens for p in pending})
        return None

    def flush(self) -> None:
        pending = list(self._pending)
        super().flush()
        for p in pending:
            p.drafter.translate(p.draft)

    # ------------------------------------------------------------------------------------------- text <-> ids
    def target_text(self, ids: Sequence[int]) -> str:
        return self.target_tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def draft_text(self, ids: Sequence[int]) -> str:
        return self.runner.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def draft_ids(self, text: str) -> list[int]:
        return self.runner.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def target_ids(self, text: str) -> list[int]:
        return self.target_tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def translate_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """Target prompt ids -> drafter ids: text runs re-encoded, special tokens mapped or dropped."""
        out: list[int] = []
        run: list[int] = []
        for token in list(prompt_ids) + [None]:
            if token is None or token in self.target_specials:
                out += self.draft_ids(self.target_text(run))
                run = []
                if token is not None and self.mapping.target_to_draft[token] >= 0:
                    out.append(int(self.mapping.target_to_draft[token]))
            else:
                run.append(token)
        return out


@functools.lru_cache(maxsize=4)
def _token_table(runner: ModelRunner) -> tuple[list[bytes | None], list[bytes], list[int]]:
    """A drafter's tokens' bytes by id, and its ordinary tokens' bytes sorted, with their ids: the tokens that start
    with some bytes are one contiguous run of that order. Built once per draft model (slow for Gemma's 262k tokens),
    not per pool: a pool lives one decoder."""
    table = token_bytes(runner.tokenizer)[: runner.vocab_size]
    pairs = sorted((b, i) for i, b in enumerate(table) if b)
    return table, [b for b, _ in pairs], [i for _, i in pairs]


def _successor(prefix: bytes) -> bytes:
    """The first bytes string after every string that starts with `prefix` (in sorted order)."""
    trimmed = prefix.rstrip(b"\xff")
    return trimmed[:-1] + bytes([trimmed[-1] + 1]) if trimmed else b"\xff" * (len(prefix) + 1)


class CrossVocabDrafter(PooledDrafter):
    """One row of a draft model with another tokenizer: the accepted text is carried back into the drafter's tokens
    each step (see the module docstring); subclasses say how a drafted token is chosen (`choose`) and how the
    draft, in the drafter's ids, becomes target ids (`translate`, called by the pool after each flush)."""

    # Which of the drafter's logits this drafter needs (a declared need): "all"; "shared", the tokens the target
    # shares (what TLI reads): then the pool's forwards compute the drafter's head over those tokens alone
    # (SubsetHead), the others staying -inf; or "frequent", the drafter's frequent tokens and the row's own
    # (`own_tokens`: its prompt's and its text's; frequent_tokens.py), for a drafter whose draft is only a proposal.
    head_tokens: str = "all"
    # Whether the drafter re-drafts the last drafter token of the generated text (token healing, module docstring):
    # only for drafters whose draft is read as text (SLEM); TLI/union/SLRS verify the drafter's own tokens' q.
    heals_boundary: bool = False

    def __init__(self, pool: CrossVocabPool, num_tokens: int = DEFAULT_DRAFT_TOKENS,
                 adaptive: bool = DEFAULTS.adaptive, max_tokens: int = DEFAULTS.max_draft_tokens,
                 confidence: float | str = 0.0):
        super().__init__(pool, num_tokens, adaptive, max_tokens)
        # Drafting stops once the draft model is less sure of the draft than this; "priced": than the decoder's
        # running price of one more drafted token (speculation_budget.DraftPricing).
        self.confidence = confidence
        self.prices_its_length = confidence == PRICED
        self._draft_probability = 1.0
        self._prompt: list[int] = []  # the prompt in the drafter's tokens
        # (committed target ids, their text, their drafter ids fed, the loop's limit, the text held back to heal)
        self._step: tuple[list[int], str, list[int], int, str] | None = None
        self._healing: torch.Tensor | None = None  # [n] the tokens this step's first drafted token must be one of
        self.own_tokens: set[int] = set()  # head_tokens "frequent": the row's drafter tokens that are not frequent
        self._own_checked = 0

    def start(self, tokens: Sequence[int], request: RequestContext) -> None:
        super().start(tokens, request)
        self._prompt = self.pool.translate_prompt(tokens[: request.prompt_len])
        self.own_tokens = self.pool.frequent.missing(self._prompt) if self.head_tokens == "frequent" else set()
        self._own_checked = 0  # the generated text's drafter tokens before this were looked at (bar a re-encoding)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> Draft:
        budget = min(self.length.current, max_tokens)
        self._draft_probability = 1.0  # the draft model's probability of this step's draft so far (sure_of)
        if budget <= 0:
            return self._request(tokens, 0)
        generated = list(tokens[self.request.prompt_len:])  # target ids, the pending one included
        text = self.pool.target_text(generated)
        draft_generated = self.pool.draft_ids(text)
        self._healing = self.pool.tokens_extending(draft_generated[-1]) \
            if self.heals_boundary and draft_generated and self.pool.is_indent(draft_generated[-1]) else None
        healed = ""
        if self._healing is not None:
            healed = self.pool.draft_text(draft_generated[-1:])
            draft_generated = draft_generated[:-1]  # re-drafted: the first draft token starts with its bytes
        if self.head_tokens == "frequent":  # the text's rare tokens (a name it coined), and what healing may pick
            self.own_tokens |= self.pool.frequent.missing(draft_generated[max(0, self._own_checked - LOOK_BEHIND):])
            self._own_checked = len(draft_generated)
            if self._healing is not None:
                self.own_tokens |= self.pool.frequent.missing(self._healing.tolist())
        sequence = self._prompt + draft_generated
        if not sequence:  # nothing the drafter could read (a prompt of special tokens it lacks, nothing generated)
            self._step = None
            return self._request(sequence, 0)
        self._step = (generated, text, draft_generated, max_tokens, healed)
        return self._request(sequence, budget, extra=1 if healed else 0)  # (healing re-drafts one token)

    def choose(self, logits: torch.Tensor, probs: list[torch.Tensor]) -> tuple[int | None, bool]:
        """The drafter's next token, in its own vocabulary (logits [|D|]): its argmax or a draw from q (the first
        token of a healing step among the tokens that extend the one held back, q renormalised over them)."""
        if self._healing is not None:
            healed = torch.full_like(logits, float("-inf"))
            healed[self._healing] = logits[self._healing]
            logits, self._healing = healed, None
        if self.request.sampling is None or self.request.sampling.greedy:
            # The argmax and its probability from one pass in fp32: cheaper than torch.argmax on Gemma's 262k bf16
            # logits and a softmax for one probability (decisions.md: specdec_core/drafters/cross_vocab_model.py).
            values = logits.float()
            top, index = values.max(dim=-1)
            token, floor = int(index), self.confidence_floor()
            if floor <= 0:
                return token, True
            return token, self.sure_with(float(1.0 / torch.exp(values - top).sum()), floor)
        token, more = choose_token(self.request, logits, probs)
        return token, more and self.sure_of(logits, token)

    def sure_of(self, logits: torch.Tensor, token: int) -> bool:
        """Whether drafting may go on after `token`: while the draft model's probability of the whole draft so far
        (the product of its tokens' probabilities at temperature 1) stays at least `confidence_floor()` (the fixed
        `confidence`, or by default the decoder's running price of one more drafted token, DraftPricing). A draft
        goes on only while it is likely to be accepted, which saves drafter forwards and verified positions. Any rule
        that looks only at the drafter's side keeps every method lossless.

        Why the whole draft's probability and not each token's (HF's assistant confidence threshold): every later
        token is accepted only if all before it were, so a run of tokens each at 0.5 is worth less than its last
        token's 0.5 says (faster passes: docs/decisions.md, "Cross-vocabulary drafting")."""
        floor = self.confidence_floor()
        if floor <= 0:
            return True
        return self.sure_with(float(torch.softmax(logits.float(), dim=-1)[token]), floor)

    def sure_with(self, probability: float, floor: float) -> bool:
        """`sure_of`, given the drafted token's probability and the floor (read once per token)."""
        self._draft_probability *= probability
        return self._draft_probability >= floor

    def confidence_floor(self) -> float:
        if self.confidence != PRICED:
            return float(self.confidence)
        sampling = self.request.sampling
        if sampling is not None and not sampling.greedy and sampling.seed is not None:
            # A seeded sampling row's draws depend on its draft lengths: a price read off the clock would make
            # them differ run to run (the loop verifies its drafts as proposed for the same reason).
            return UNPRICED_FLOOR
        measured = self.pool.pricing.floor() if self.pool.pricing is not None else None
        return UNPRICED_FLOOR if measured is None else measured

    @abstractmethod
    def translate(self, draft: Draft) -> None:
        """After the pool drafted (drafter ids in draft.tokens): replace them, in place, by target ids."""


class SlemDrafter(CrossVocabDrafter):
    """SLEM: drafts `num_tokens` drafter tokens per step and proposes their TEXT in the target's tokens (one-hot).

    It drafts through the drafter's head over its frequent tokens and the row's own (frequent_tokens.py): its draft
    is only a proposal, so a token it cannot name costs at most a shorter accepted draft. Without the prompt's own
    tokens it could not copy the prompt's identifiers (docs/decisions.md, "Cross-vocabulary drafting")."""

    heals_boundary = True
    head_tokens = "frequent"

    def translate(self, draft: Draft) -> None:
        if self._step is None or not draft.tokens:
            draft.tokens[:] = []
            draft.probs = None
            return
        generated, text, draft_generated, max_tokens, healed = self._step
        full = self.pool.draft_text(draft_generated + draft.tokens)
        if full.startswith(text):
            proposal = full[len(text):]
        else:  # the drafter's decoding does not round-trip the text: the draft's own text, less what healing redrafted
            proposal = self.pool.draft_text(draft.tokens)
            proposal = proposal[len(healed):] if proposal.startswith(healed) else ""
        if REPLACEMENT in proposal:  # an unfinished character: propose the text before it
            proposal = proposal[: proposal.index(REPLACEMENT)]
        draft.tokens[:] = self.target_tokens(generated, proposal)[:max_tokens]
        draft.probs = None  # one-hot in the target's vocabulary: verified by exact match / the target's draws

    def target_tokens(self, generated: list[int], proposal: str) -> list[int]:
        if not proposal:
            return []
        behind = generated[-LOOK_BEHIND:]
        if behind:
            joint = self.pool.target_ids(self.pool.target_text(behind) + proposal)
            if joint[: len(behind)] == behind and len(joint) > len(behind):
                return joint[len(behind):]
        return self.pool.target_ids(proposal)
