"""Registry of decoding methods by name: each entry builds a fresh per-request drafter. No if/elif on names.

The names, descriptions and options load without torch; the drafters each method builds live in
drafters/factories.py, loaded on the first drafter built. A job's argument check, `--help` and the Ray Data workers
that only read and tokenize rows never import the engine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import UnknownMethodError
from .method_options import MethodOptions

if TYPE_CHECKING:
    from .drafters.factories import DrafterFactory, RuleFactory


@dataclass(frozen=True)
class MethodSpec:
    name: str
    description: str
    needs_draft_model: bool = False
    lossless: bool = True  # False: its drafts are verified by a lossy rule (factories.RULES) and its rows say so
    uses_job_memory: bool = False  # its decoders get the engine's job memory for the method (job_memory.py)

    @property
    def build_drafter(self) -> DrafterFactory:
        """(options, draft-model pool or None) -> a fresh per-request drafter."""
        return _factories().DRAFTERS[self.name]

    @property
    def verification(self) -> RuleFactory | None:
        """How its drafts are verified: None exactly, else options -> the lossy rule."""
        return _factories().RULES.get(self.name)


METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("ar", "plain autoregressive decoding with a KV cache (the baseline)"),
    MethodSpec("pld", "prompt lookup: match the last 3..1 tokens in the history, draft the K that followed"),
    MethodSpec("pld_plus_h", "PLD+ (h): prompt lookup of the last token, occurrences ranked by the cosine similarity "
                             "of the target's layer-l hidden states (lossless)"),
    MethodSpec("pld_plus_a", "PLD+ (a): prompt lookup of the last token, occurrences ranked by the attention of the "
                             "target's induction heads (found once per model and saved; lossless)"),
    MethodSpec("casd_strict", "CASD's retrieval, verified exactly: a draft tree of the continuations of the longest "
                              "suffix match in the row's context (else its prompt), REST-style (lossless)"),
    MethodSpec("casd", "CASD: context draft trees, a node accepted when p(token) > max(delta, p(EOS)) and its parent "
                       "was (LOSSY: it may differ from ar; greedy only)", lossless=False),
    MethodSpec("casd_mixed", "CASD (mixed): as casd, and the token must be in the top-k of the target's distribution "
                             "(LOSSY; greedy only)", lossless=False),
    MethodSpec("spectra", "SPECTRA-CORE: guesses from forward/backward n-gram dictionaries that a pool of W rows, "
                          "extended by the verify forward itself, keeps filling (lossless)"),
    MethodSpec("rest", "REST: a draft tree of the continuations of the longest suffix match in a corpus index "
                       "(--retrieval-index; lossless)"),
    MethodSpec("spectra+retrieval", "SPECTRA with the corpus index's continuations filling the guesses left after "
                                    "its own (--retrieval-index; lossless)"),
    MethodSpec("copyspec", "CopySpec: copy m tokens after the first earlier occurrence of the last γ tokens"),
    MethodSpec("suffix", "SuffixDecoding: a frequency-ranked draft tree from the longest suffix match in the "
                         "request's own text or in the job memory (the outputs of the job's earlier and running "
                         "rows; lossless)", uses_job_memory=True),
    MethodSpec("auto", "per row and step, the drafter expected to give the most accepted tokens: suffix trees (own "
                       "text, job memory), CopySpec (history, context), the draft model when one is loaded "
                       "(lossless)", uses_job_memory=True),
    MethodSpec("draft", "speculative decoding with a same-vocabulary draft model (δ tokens per step)",
                        needs_draft_model=True),
    MethodSpec("slem", "SLEM: a draft model with ANY tokenizer drafts text, re-tokenized into the target's tokens "
                       "and verified by exact match (lossless; Timor et al. Alg. 2)", needs_draft_model=True),
    MethodSpec("tli", "TLI: a draft model with ANY tokenizer samples only the tokens both vocabularies share, "
                      "verified by speculative sampling (lossless at any temperature; Timor et al. Alg. 4)",
                      needs_draft_model=True),
    MethodSpec("union", "the union-of-vocabularies baseline for tli: the drafter samples its whole vocabulary, a "
                        "token the target lacks is always rejected (lossless; Timor et al. Alg. 1)",
                        needs_draft_model=True),
    MethodSpec("slrs", "SLRS with a one-token lookahead: a draft model with ANY tokenizer samples a token; the first "
                       "target token of its text is verified against the string-level probability psi (lossless at "
                       "any temperature; Timor et al. Alg. 3)", needs_draft_model=True),
    MethodSpec("copyspec+draft", "CopySpec when the index matches, else the draft model (CopySpec §3.3)",
                                 needs_draft_model=True),
)}


@functools.cache
def _factories():
    # Lazy: keeps torch out of a job's argument check, --help and the Ray Data workers that only read and tokenize.
    from .drafters import factories

    lossy = {name for name, spec in METHODS.items() if not spec.lossless}
    if set(factories.DRAFTERS) != set(METHODS) or lossy != set(factories.RULES):
        raise RuntimeError("methods.METHODS and drafters/factories.py name different methods")
    return factories


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
