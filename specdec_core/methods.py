"""Registry of decoding methods by name: each entry builds a fresh per-request drafter. No if/elif on names.

The names and options load without torch: a factory imports its drafter when it builds one, so a job's argument
check, `--help` and the Ray Data workers that only read and tokenize rows do not pay the engine's ~7 s of imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import UnknownMethodError

if TYPE_CHECKING:
    from .drafters.base import Drafter
    from .drafters.copyspec import CopySpecDrafter
    from .drafters.draft_model import DraftModelDrafter, DraftModelPool
    from .drafters.retrieval import RetrievalTreeDrafter
    from .drafters.suffix import SuffixDrafter
    from .loop.verification import ConditionalRule


class MethodOptions(BaseModel):
    """Knobs of the drafters; every method reads the ones it uses."""

    model_config = ConfigDict(extra="forbid")

    gamma: int = Field(3, ge=1, description="CopySpec: tokens in the matched suffix (γ)")
    copy_tokens: int = Field(10, ge=1, description="CopySpec: tokens copied per match (m)")
    max_copy_tokens: int = Field(64, ge=1, description="CopySpec adaptive: upper bound on m")
    lookup_tokens: int = Field(10, ge=1, description="prompt lookup: tokens drafted per match (K)")
    max_ngram: int = Field(3, ge=1, description="prompt lookup: longest suffix n-gram tried")
    min_ngram: int = Field(1, ge=1, description="prompt lookup: shortest suffix n-gram tried")
    draft_tokens: int | None = Field(None, ge=1, description="draft model: most tokens drafted per step (δ); "
                                     "default 4 for draft, max_draft_tokens for slem/tli/union/slrs, whose "
                                     "confidence stop ends most drafts first")
    max_draft_tokens: int = Field(16, ge=1, description="draft model adaptive: upper bound on δ")
    adaptive: bool = Field(False, description="grow the draft length after full acceptance, shrink after rejections")
    draft_confidence: float | Literal["priced"] = Field(
        "priced", description="slem/tli/union/slrs: stop drafting once the draft model gives the draft so far (the "
        "product of its tokens' probabilities) less than this; 'priced' (default): less than what one more drafted "
        "token costs (a share of a drafter forward and its verification) over what a token is worth (the decoder's "
        "measured seconds per token), so the stop follows the drafter's price; 0 = draft the full length")
    candidates: int = Field(1, ge=1, le=16, description="copyspec/pld: distinct earlier continuations drafted as "
                                                        "branches of one tree (1 = a single chain)")
    hidden_layer: int | None = Field(None, ge=0, description="PLD+ (h): the target layer whose hidden states rank "
                                                             "the occurrences (default: a tuned fraction of depth)")
    top_heads: int = Field(50, ge=1, description="PLD+ (a): how many of the target's best induction heads rank "
                                                 "the occurrences (paper: 50)")
    casd_delta: float = Field(0.1, gt=0.0, le=1.0, description="CASD: accept a context token when its probability "
                                                              "exceeds max(delta, p(EOS)) (paper: 0.1)")
    casd_top_k: int = Field(5, ge=1, description="casd_mixed: the token must also be in the top k (paper: 5)")
    tree_nodes: int = Field(32, ge=1, le=64, description="CASD: most nodes of a retrieved draft tree")
    similarity_threshold: float | None = Field(0.0, ge=-1.0, le=1.0, description="PLD+ (h): draft only from an "
                                               "occurrence whose cosine similarity exceeds this (None: any)")
    spectra_n: int = Field(5, ge=2, le=16, description="SPECTRA: n-gram length N of the dictionaries and pool rows")
    spectra_pool: int = Field(15, ge=0, le=64, description="SPECTRA: pool rows W the target extends each step (also "
                                                          "the continuations kept per forward key)")
    spectra_guesses: int = Field(15, ge=1, le=64, description="SPECTRA: most guesses G per step")
    retrieval_index: str | None = Field(None, description="rest / spectra+retrieval: a corpus index directory "
                                                          "(specdec_core/retrieval_index.py)")
    spectra_tau: float = Field(0.1, ge=0.0, le=1.0, description="SPECTRA: a pool row takes the plain argmax when "
                                                                "r <= tau, else the best token not yet a forward key")
    suffix_spec_factor: float = Field(1.0, gt=0.0, description="suffix: a draft tree has at most this x the matched "
                                                               "suffix's length nodes (vLLM's default 1.0)")
    suffix_min_prob: float = Field(0.1, ge=0.0, le=1.0, description="suffix: draft-tree branches whose estimated "
                                                                     "probability is below this are cut (0.1)")

    @field_validator("draft_confidence")
    @classmethod
    def _confidence_range(cls, value):
        if not isinstance(value, str) and not 0.0 <= value <= 1.0:
            raise ValueError(f"draft_confidence must be 'priced' or within [0, 1], got {value}")
        return value


DEFAULT_DRAFT_TOKENS = 4  # a draft model's tokens per step when the method has no stop of its own (δ)

# The factory's second argument is the decoder's draft-model pool (None without a draft model): every draft-model
# drafter of one decoder shares it, so the draft model steps all their rows in one forward.
DrafterFactory = Callable[[MethodOptions, "DraftModelPool | None"], "Drafter"]
# A lossy method's verification rule, from its options (None in MethodSpec: drafts are verified exactly).
RuleFactory = Callable[[MethodOptions], "ConditionalRule"]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    description: str
    build_drafter: DrafterFactory
    needs_draft_model: bool = False
    lossless: bool = True
    uses_job_memory: bool = False  # its decoders get the engine's job memory for the method (job_memory.py)
    verification: RuleFactory | None = None  # how its drafts are verified: None exactly, else by this lossy rule


METHODS: dict[str, MethodSpec] = {}


def register(name: str, description: str, needs_draft_model: bool = False, lossless: bool = True,
             uses_job_memory: bool = False, verification: RuleFactory | None = None):
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        if name in METHODS:
            raise ValueError(f"method {name!r} registered twice")
        METHODS[name] = MethodSpec(name, description, factory, needs_draft_model, lossless, uses_job_memory,
                                   verification)
        return factory

    return wrap


def check_method_names(methods: list[str]) -> list[str]:
    """For config validators: every name registered, none twice (ValueError naming the choices otherwise)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError("a method is listed twice")
    return methods


def get_method(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise UnknownMethodError(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}") from None


def register_lossy(name: str, description: str, verification: RuleFactory):
    """A lossy method, its drafts verified by `verification`'s rule: its rows say lossy = true and reports keep them
    apart from the exact ones."""
    return register(name, description, lossless=False, verification=verification)


@register("ar", "plain autoregressive decoding with a KV cache (the baseline)")
def _ar(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.base import NoDrafter

    return NoDrafter()


@register("pld", "prompt lookup: match the last 3..1 tokens in the history, draft the K that followed")
def _pld(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(options.lookup_tokens, options.max_ngram, options.min_ngram, options.adaptive,
                               options.candidates)


@register("pld_plus_h", "PLD+ (h): prompt lookup of the last token, occurrences ranked by the cosine similarity "
                        "of the target's layer-l hidden states (lossless)")
def _pld_plus_h(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.pld_plus import HiddenStateLookupDrafter

    return HiddenStateLookupDrafter(options.hidden_layer, options.lookup_tokens, options.similarity_threshold,
                                    options.adaptive)


@register("pld_plus_a", "PLD+ (a): prompt lookup of the last token, occurrences ranked by the attention of the "
                        "target's induction heads (found once per model and saved; lossless)")
def _pld_plus_a(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.pld_plus import AttentionLookupDrafter

    return AttentionLookupDrafter(options.lookup_tokens, options.top_heads, options.adaptive)


@register("casd_strict", "CASD's retrieval, verified exactly: a draft tree of the continuations of the longest "
                         "suffix match in the row's context (else its prompt), REST-style (lossless)")
def _casd_strict(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.casd import ContextTreeDrafter

    return ContextTreeDrafter(options.tree_nodes)


def _casd_rule(options: MethodOptions) -> ConditionalRule:
    from .loop.verification import ConditionalRule

    return ConditionalRule(options.casd_delta)


def _casd_mixed_rule(options: MethodOptions) -> ConditionalRule:
    from .loop.verification import ConditionalRule

    return ConditionalRule(options.casd_delta, options.casd_top_k)


@register_lossy("casd", "CASD: context draft trees, a node accepted when p(token) > max(delta, p(EOS)) and its "
                        "parent was (LOSSY: it may differ from ar; greedy only)", _casd_rule)
def _casd(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _casd_strict(options, draft_model)


@register_lossy("casd_mixed", "CASD (mixed): as casd, and the token must be in the top-k of the target's "
                              "distribution (LOSSY; greedy only)", _casd_mixed_rule)
def _casd_mixed(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _casd_strict(options, draft_model)


@register("spectra", "SPECTRA-CORE: guesses from forward/backward n-gram dictionaries that a pool of W rows, "
                     "extended by the verify forward itself, keeps filling (lossless)")
def _spectra(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.spectra import SpectraDrafter

    return SpectraDrafter(options.spectra_n, options.spectra_pool, options.spectra_guesses, options.spectra_tau)


def _retriever(options: MethodOptions) -> RetrievalTreeDrafter:
    from .drafters.retrieval import RetrievalTreeDrafter
    from .retrieval_index import load_index

    if not options.retrieval_index:
        raise UnknownMethodError("this method retrieves from a corpus index: pass --retrieval-index PATH")
    return RetrievalTreeDrafter(load_index(options.retrieval_index), options.tree_nodes)


@register("rest", "REST: a draft tree of the continuations of the longest suffix match in a corpus index "
                  "(--retrieval-index; lossless)")
def _rest(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _retriever(options)


@register("spectra+retrieval", "SPECTRA with the corpus index's continuations filling the guesses left after its "
                               "own (--retrieval-index; lossless)")
def _spectra_retrieval(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.spectra import SpectraDrafter

    return SpectraDrafter(options.spectra_n, options.spectra_pool, options.spectra_guesses, options.spectra_tau,
                          retriever=_retriever(options))


def _copyspec_drafter(options: MethodOptions) -> CopySpecDrafter:
    from .drafters.copyspec import CopySpecDrafter

    return CopySpecDrafter(options.gamma, options.copy_tokens, options.adaptive, options.max_copy_tokens,
                           options.candidates)


def _draft_model_drafter(options: MethodOptions, draft_model: DraftModelPool | None) -> DraftModelDrafter:
    from .drafters.cross_vocab_model import CrossVocabPool
    from .drafters.draft_model import DraftModelDrafter

    if draft_model is None:
        raise UnknownMethodError("this method needs a draft model: pass --drafter NAME")
    if isinstance(draft_model, CrossVocabPool):
        raise UnknownMethodError(f"draft model {draft_model.runner.name!r} has a different tokenizer from the "
                                 "target: draft and copyspec+draft verify its token ids as the target's; use slem, "
                                 "tli, union or slrs, which draft across vocabularies")
    return DraftModelDrafter(draft_model, options.draft_tokens or DEFAULT_DRAFT_TOKENS, options.adaptive,
                             options.max_draft_tokens)


@register("copyspec", "CopySpec: copy m tokens after the first earlier occurrence of the last γ tokens")
def _copyspec(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _copyspec_drafter(options)


@register("suffix", "SuffixDecoding: a frequency-ranked draft tree from the longest suffix match in the request's "
                    "own text or in the job memory (the outputs of the job's earlier and running rows; lossless)",
          uses_job_memory=True)
def _suffix(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _suffix_drafter(options)


def _suffix_drafter(options: MethodOptions) -> SuffixDrafter:
    from .drafters.suffix import SuffixDrafter

    return SuffixDrafter(options.suffix_spec_factor, options.suffix_min_prob)


@register("auto", "per row and step, the drafter expected to give the most accepted tokens: suffix trees (own "
                  "text, job memory), CopySpec (history, context), the draft model when one is loaded (lossless)",
          uses_job_memory=True)
def _auto(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.cascade import CascadeDrafter
    from .drafters.cross_vocab_model import SlemDrafter

    candidates = [_suffix_drafter(options), _copyspec_drafter(options)]
    if draft_model is not None:  # the target's tokenizer: plain drafts; another: SLEM's, which cross vocabularies
        candidates.append(_cross_vocab("auto", SlemDrafter, options, draft_model))
    return CascadeDrafter(candidates)


@register("draft", "speculative decoding with a same-vocabulary draft model (δ tokens per step)", True)
def _draft(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _draft_model_drafter(options, draft_model)


@register("slem", "SLEM: a draft model with ANY tokenizer drafts text, re-tokenized into the target's tokens and "
                  "verified by exact match (lossless; Timor et al. Alg. 2)", True)
def _slem(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.cross_vocab_model import SlemDrafter

    return _cross_vocab("slem", SlemDrafter, options, draft_model)


def _cross_vocab(name: str, drafter_class, options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.cross_vocab_model import CrossVocabPool

    if draft_model is None:
        raise UnknownMethodError(f"{name} needs a draft model: pass --drafter NAME")
    if not isinstance(draft_model, CrossVocabPool):  # the target's own tokenizer: every token is shared
        return _draft_model_drafter(options, draft_model)
    # A drafter that stops on its own confidence may draft up to the most tokens: the stop, not the length, ends
    # its drafts (measured, Gemma 3 for Qwen2.5-Coder-1.5B, batch 1: 16 tokens and the priced stop took 41 steps for
    # 5 x 64 tokens against 63-70 with 8 tokens adapted and the plan's cap).
    stops_itself = options.draft_confidence != 0
    length = options.draft_tokens or (options.max_draft_tokens if stops_itself else DEFAULT_DRAFT_TOKENS)
    return drafter_class(draft_model, length, options.adaptive, options.max_draft_tokens, options.draft_confidence)


@register("tli", "TLI: a draft model with ANY tokenizer samples only the tokens both vocabularies share, verified "
                 "by speculative sampling (lossless at any temperature; Timor et al. Alg. 4)", True)
def _tli(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.tli import TliDrafter

    return _cross_vocab("tli", TliDrafter, options, draft_model)


@register("union", "the union-of-vocabularies baseline for tli: the drafter samples its whole vocabulary, a token "
                   "the target lacks is always rejected (lossless; Timor et al. Alg. 1)", True)
def _union(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.tli import UnionDrafter

    return _cross_vocab("union", UnionDrafter, options, draft_model)


@register("slrs", "SLRS with a one-token lookahead: a draft model with ANY tokenizer samples a token; the first target "
                  "token of its text is verified against the string-level probability psi (lossless at any "
                  "temperature; Timor et al. Alg. 3)", True)
def _slrs(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.slrs import SlrsDrafter

    return _cross_vocab("slrs", SlrsDrafter, options, draft_model)


@register("copyspec+draft", "CopySpec when the index matches, else the draft model (CopySpec §3.3)", True)
def _copyspec_draft(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    from .drafters.fallback import FallbackDrafter

    return FallbackDrafter([_copyspec_drafter(options), _draft_model_drafter(options, draft_model)])
