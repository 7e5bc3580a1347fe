"""The drafters' knobs and their defaults, in one place: the registry builds drafters from them, the CLI's and the
jobs' flags are generated from them (cli.add_method_options), and each drafter's constructor defaults to them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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
                                                          "(specdec_core/drafters/retrieval_index.py)")
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


DEFAULTS = MethodOptions()
DEFAULT_DRAFT_TOKENS = 4  # a draft model's tokens per step when the method has no stop of its own (δ)
