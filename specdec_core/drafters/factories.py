"""The drafter each method builds from its options, and the verification rule of each lossy method: the registry's
heavy half (it imports every drafter, so torch). specdec_core/methods.py names the methods and loads this on the first
drafter it builds."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import UnknownMethodError
from ..loop.verification import ConditionalRule
from ..method_options import DEFAULT_DRAFT_TOKENS
from .base import Drafter, NoDrafter
from .cascade import CascadeDrafter
from .casd import ContextTreeDrafter
from .copyspec import CopySpecDrafter
from .cross_vocab_model import CrossVocabPool, SlemDrafter
from .draft_model import DraftModelDrafter, DraftModelPool
from .fallback import FallbackDrafter
from .pld_plus import AttentionLookupDrafter, HiddenStateLookupDrafter
from .prompt_lookup import PromptLookupDrafter
from .retrieval import RetrievalTreeDrafter
from .retrieval_index import load_index
from .slrs import SlrsDrafter
from .spectra import SpectraDrafter
from .suffix import SuffixDrafter
from .tli import TliDrafter, UnionDrafter

if TYPE_CHECKING:
    from ..method_options import MethodOptions

# The factory's second argument is the decoder's draft-model pool (None without a draft model): every draft-model
# drafter of one decoder shares it, so the draft model steps all their rows in one forward.
DrafterFactory = Callable[["MethodOptions", "DraftModelPool | None"], Drafter]
# A lossy method's verification rule, from its options.
RuleFactory = Callable[["MethodOptions"], ConditionalRule]

DRAFTERS: dict[str, DrafterFactory] = {}
RULES: dict[str, RuleFactory] = {}  # the lossy methods; every other method's drafts are verified exactly


def builds(name: str):
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        if name in DRAFTERS:
            raise ValueError(f"method {name!r} built twice")
        DRAFTERS[name] = factory
        return factory

    return wrap


@builds("ar")
def _ar(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return NoDrafter()


@builds("pld")
def _pld(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return PromptLookupDrafter(options.lookup_tokens, options.max_ngram, options.min_ngram, options.adaptive,
                               options.candidates)


@builds("pld_plus_h")
def _pld_plus_h(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return HiddenStateLookupDrafter(options.hidden_layer, options.lookup_tokens, options.similarity_threshold,
                                    options.adaptive)


@builds("pld_plus_a")
def _pld_plus_a(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return AttentionLookupDrafter(options.lookup_tokens, options.top_heads, options.adaptive)


@builds("casd_strict")
def _casd_strict(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return ContextTreeDrafter(options.tree_nodes)


def _casd_rule(options: MethodOptions) -> ConditionalRule:
    return ConditionalRule(options.casd_delta)


def _casd_mixed_rule(options: MethodOptions) -> ConditionalRule:
    return ConditionalRule(options.casd_delta, options.casd_top_k)


RULES.update(casd=_casd_rule, casd_mixed=_casd_mixed_rule)


@builds("casd")
def _casd(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _casd_strict(options, draft_model)


@builds("casd_mixed")
def _casd_mixed(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _casd_strict(options, draft_model)


@builds("spectra")
def _spectra(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return SpectraDrafter(options.spectra_n, options.spectra_pool, options.spectra_guesses, options.spectra_tau)


def _retriever(options: MethodOptions) -> RetrievalTreeDrafter:
    if not options.retrieval_index:
        raise UnknownMethodError("this method retrieves from a corpus index: pass --retrieval-index PATH")
    return RetrievalTreeDrafter(load_index(options.retrieval_index), options.tree_nodes)


@builds("rest")
def _rest(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _retriever(options)


@builds("spectra+retrieval")
def _spectra_retrieval(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return SpectraDrafter(options.spectra_n, options.spectra_pool, options.spectra_guesses, options.spectra_tau,
                          retriever=_retriever(options))


def _copyspec_drafter(options: MethodOptions) -> CopySpecDrafter:
    return CopySpecDrafter(options.gamma, options.copy_tokens, options.adaptive, options.max_copy_tokens,
                           options.candidates)


def _draft_model_drafter(options: MethodOptions, draft_model: DraftModelPool | None) -> DraftModelDrafter:
    if draft_model is None:
        raise UnknownMethodError("this method needs a draft model: pass --drafter NAME")
    if isinstance(draft_model, CrossVocabPool):
        raise UnknownMethodError(f"draft model {draft_model.runner.name!r} has a different tokenizer from the "
                                 "target: draft and copyspec+draft verify its token ids as the target's; use slem, "
                                 "tli, union or slrs, which draft across vocabularies")
    return DraftModelDrafter(draft_model, options.draft_tokens or DEFAULT_DRAFT_TOKENS, options.adaptive,
                             options.max_draft_tokens)


@builds("copyspec")
def _copyspec(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _copyspec_drafter(options)


@builds("suffix")
def _suffix(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _suffix_drafter(options)


def _suffix_drafter(options: MethodOptions) -> SuffixDrafter:
    return SuffixDrafter(options.suffix_spec_factor, options.suffix_min_prob)


@builds("auto")
def _auto(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    candidates = [_suffix_drafter(options), _copyspec_drafter(options)]
    if draft_model is not None:  # the target's tokenizer: plain drafts; another: SLEM's, which cross vocabularies
        candidates.append(_cross_vocab("auto", SlemDrafter, options, draft_model))
    return CascadeDrafter(candidates)


@builds("draft")
def _draft(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _draft_model_drafter(options, draft_model)


@builds("slem")
def _slem(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _cross_vocab("slem", SlemDrafter, options, draft_model)


def _cross_vocab(name: str, drafter_class, options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    if draft_model is None:
        raise UnknownMethodError(f"{name} needs a draft model: pass --drafter NAME")
    if not isinstance(draft_model, CrossVocabPool):  # the target's own tokenizer: every token is shared
        return _draft_model_drafter(options, draft_model)
    # A drafter that stops on its own confidence may draft up to the most tokens: the stop, not the length, ends
    # its drafts, in fewer steps than an adapted length (decisions.md: specdec_core/drafters/factories.py).
    stops_itself = options.draft_confidence != 0
    length = options.draft_tokens or (options.max_draft_tokens if stops_itself else DEFAULT_DRAFT_TOKENS)
    return drafter_class(draft_model, length, options.adaptive, options.max_draft_tokens, options.draft_confidence)


@builds("tli")
def _tli(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _cross_vocab("tli", TliDrafter, options, draft_model)


@builds("union")
def _union(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _cross_vocab("union", UnionDrafter, options, draft_model)


@builds("slrs")
def _slrs(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return _cross_vocab("slrs", SlrsDrafter, options, draft_model)


@builds("copyspec+draft")
def _copyspec_draft(options: MethodOptions, draft_model: DraftModelPool | None) -> Drafter:
    return FallbackDrafter([_copyspec_drafter(options), _draft_model_drafter(options, draft_model)])
